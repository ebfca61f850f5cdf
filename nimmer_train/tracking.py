"""MLflow tracking: one run per stage, one experiment per pipeline, nested under run_all.

The default store is embedded (SQLite file plus a local artifact folder, no server);
``tracking.uri`` points at a tracking server instead. A run logs the resolved config (flattened
params and config.yaml), the git commit, dataset lineage, metrics as they happen and the stage's
output manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlflow
from mlflow.entities import Metric
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from nimmer_train.artifacts import MANIFEST, git_commit
from nimmer_train.config import Config, TrackingConfig

MetricLogger = Callable[[dict[str, float], int], None]


def configure(cfg: TrackingConfig) -> str:
    """Point MLflow at the configured store and return its URI."""
    uri = cfg.tracking_uri()
    mlflow.set_tracking_uri(uri)
    return uri


def ui_command(cfg: TrackingConfig) -> str:
    """The exact command a reviewer runs to open these runs."""
    if cfg.uri:
        return f"open {cfg.uri} in a browser (tracking server)"
    root = Path(cfg.artifact_root).resolve()
    return f"mlflow ui --backend-store-uri {cfg.tracking_uri()} --default-artifact-root {root}"


# The one-line description of each stage's run (MLflow's UI shows ``mlflow.note.content`` as the
# run's and the experiment's description). A register LoRA's run is ``lora <register>``.
DESCRIPTIONS: dict[str, str] = {
    "run_all": "Every stage in data-flow order; each stage is a nested run below this one",
    "ingest": "Clean, deduplicate and chunk the literary corpus into a dataset with its data card",
    "synthesize": "Teacher-tier synthetic dialogue per register (r0), curated to r1, with its data card",
    "build_base": "Continued pretraining of the nimmerworld base: loss and perplexity curves, manifest",
    "train_loras": "Register trait-LoRAs and the register x adapter held-out loss matrix",
    "lora": "One register trait-LoRA trained on its register's r1 dialogue",
    "federate": "Flower rounds under DP: participants, dropouts, held-out loss and epsilon per round",
    "privacy_sweep": "Privacy-utility sweep: held-out loss against epsilon and population",
    "publish": "Signed base versions with manifests and model cards, mirrored to the Model Registry",
    "speak": "NPC turns spoken through the published version and its register LoRAs",
}
HISTORY_CSV = "metrics/history.csv"
CURVES_PNG = "metrics/curves.png"


def describe(stage: str) -> str:
    """The one-line description of a stage's run (``lora <register>`` names its register)."""
    if stage.startswith("lora "):
        return f"{DESCRIPTIONS['lora']} ({stage[5:]})"
    return DESCRIPTIONS.get(stage, f"nimmer-train stage {stage}")


def experiment_id(cfg: TrackingConfig, pipeline: str) -> str:
    name = f"{cfg.experiment_prefix}-{pipeline}"
    found = mlflow.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    location = None if cfg.uri else (Path(cfg.artifact_root).resolve() / name).as_uri()
    tags = {"mlflow.note.content": f"Pipeline {pipeline}: {describe(pipeline)}", "pipeline": pipeline}
    return mlflow.create_experiment(name, artifact_location=location, tags=tags)


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """Flatten nested dicts to dotted keys; lists become JSON strings."""
    out: dict[str, str] = {}
    if isinstance(obj, dict):
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}{key}."))
    else:
        out[prefix[:-1]] = json.dumps(obj) if isinstance(obj, list) else str(obj)
    return out


def config_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


@contextlib.contextmanager
def stage_run(
    cfg: Config, pipeline: str, stage: str, resume_run_id: str | None = None
) -> Iterator[str | None]:
    """Open the MLflow run for one stage and yield its id (None when tracking is disabled).

    Inside an active run (run_all's parent) the stage run is nested in it. ``resume_run_id``
    continues a run that a killed job left behind.
    """
    if not cfg.tracking.enabled:
        yield None
        return
    configure(cfg.tracking)
    parent = mlflow.active_run()
    if resume_run_id and _run_exists(resume_run_id):
        ctx = mlflow.start_run(run_id=resume_run_id, nested=parent is not None)
    else:
        name = f"{stage} · {cfg.model.name} · {cfg.experiment_name} · {time.strftime('%m-%d %H:%M:%S')}"
        exp = parent.info.experiment_id if parent else experiment_id(cfg.tracking, pipeline)
        ctx = mlflow.start_run(experiment_id=exp, run_name=name, nested=parent is not None)
    with ctx as run:
        if resume_run_id != run.info.run_id:
            log_config(cfg, stage)
        else:
            mlflow.set_tag("resumed", "true")
        yield run.info.run_id
        log_metric_histories(run.info.run_id)


def _run_exists(run_id: str) -> bool:
    try:
        MlflowClient().get_run(run_id)
        return True
    except mlflow.exceptions.MlflowException:
        return False


def log_config(cfg: Config, stage: str) -> None:
    """Resolved config as flattened params plus config.yaml, the git commit and the stage."""
    params = flatten(dataclasses.asdict(cfg))
    mlflow.log_params({k: v[:6000] for k, v in params.items()})
    mlflow.log_text(config_yaml(cfg), "config.yaml")
    commit = git_commit()
    mlflow.set_tags(
        {
            "stage": stage,
            "git_commit": commit,
            "mlflow.source.git.commit": commit,
            "experiment_preset": cfg.experiment_name,
            "mlflow.note.content": describe(stage),
        }
    )


def log_dataset(path: Path, name: str, sha256: str, context: str, dataset: Any = None) -> None:
    """Record an input dataset: mlflow.log_input plus our full sha256 as a tag."""
    if not mlflow.active_run():
        return
    from mlflow.data.dataset_source_registry import resolve_dataset_source
    from mlflow.data.meta_dataset import MetaDataset

    with warnings.catch_warnings():  # "interpreted in multiple ways", integer-schema hints
        warnings.simplefilter("ignore", UserWarning)
        source = resolve_dataset_source(path.resolve().as_uri())
        if dataset is not None:
            ds = mlflow.data.from_huggingface(dataset, name=name, digest=sha256[:32], source=source)
        else:
            ds = MetaDataset(source=source, name=name, digest=sha256[:32])
        mlflow.log_input(ds, context=context, tags={"sha256": sha256, "path": str(path.resolve())})


def log_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    if mlflow.active_run():
        mlflow.log_dict(manifest, MANIFEST)
        mlflow.set_tag("output", str(folder))


def metric_logger(run_id: str | None, uri: str | None = None) -> MetricLogger:
    """A function that logs metrics at a step to ``run_id`` (a no-op when run_id is None).

    It talks to the store by run id, so a distributed worker can log into the run that the
    launching process opened.
    """
    if run_id is None:
        return lambda metrics, step: None
    client = MlflowClient(tracking_uri=uri)

    def log(metrics: dict[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[Metric(k, float(v), now, step) for k, v in metrics.items()])

    return log


def log_metric_histories(run_id: str) -> None:
    """Every metric's history as ``metrics/history.csv`` and the ones with more than one step
    (loss curves, per-round federation figures) as ``metrics/curves.png``: artifacts a reviewer
    opens in the UI beside the run."""
    client = MlflowClient()
    histories = {key: client.get_metric_history(run_id, key) for key in client.get_run(run_id).data.metrics}
    if not histories:
        return
    rows = ["metric,step,value,timestamp"] + [
        f"{key},{m.step},{m.value!r},{m.timestamp}"
        for key, history in sorted(histories.items())
        for m in sorted(history, key=lambda m: (m.step, m.timestamp))
    ]
    mlflow.log_text("\n".join(rows) + "\n", HISTORY_CSV)
    curves = {k: h for k, h in sorted(histories.items()) if len({m.step for m in h}) > 1}
    if curves:
        mlflow.log_figure(curves_figure(curves), CURVES_PNG)


def curves_figure(curves: dict[str, list[Metric]], columns: int = 3) -> Any:
    """One small panel per metric: value against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = -(-len(curves) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4 * columns, 2.6 * rows), squeeze=False)
    for ax, (key, history) in zip(axes.flat, curves.items(), strict=False):
        points = sorted((m.step, m.value) for m in history)
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 30 else None)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(curves) :]:
        ax.set_visible(False)
    fig.tight_layout()
    plt.close(fig)
    return fig
