"""MLflow tracking: one run per stage, one experiment per pipeline, nested under run_all.

The default store is embedded (SQLite file plus a local artifact folder, no server);
``tracking.uri`` points at a tracking server instead. A run logs the resolved config (flattened
params and config.yaml), the git commit, dataset lineage, metrics as they happen and the stage's
output manifest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import sys
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


UI_HOST, UI_PORT = "127.0.0.1", 5000
WORKFLOW_ML = "workflowType=machine_learning"  # the runs table, not the GenAI view
# sorted by name, the stage runs are rows of their own: by start time (the UI's default) the UI
# folds nested runs under their run_all parent, so the table would name no stage
RUNS_TABLE = f"{WORKFLOW_ML}&orderByKey=attributes.run_name&orderByAsc=true"


def ui_command(cfg: TrackingConfig, pipeline: str = "run_all") -> str:
    """How a reviewer opens these runs, as printed by the demo: the venv's ``mlflow ui`` with
    absolute paths (it works from a fresh shell, where ``mlflow`` is not on PATH), then the URL of
    ``pipeline``'s runs table. MLflow 3.17's UI opens an experiment in its GenAI view unless the
    URL carries ``workflowType=machine_learning`` (inside the hash route: the UI's router reads it
    there); the experiment's kind tag alone does not switch it."""
    if cfg.uri:
        return f"open {runs_url(cfg, pipeline, cfg.uri)} in a browser (tracking server)"
    mlflow_bin = Path(sys.prefix) / "bin" / "mlflow"  # the venv's own, not whatever PATH holds
    root = Path(cfg.artifact_root).resolve()
    command = (
        f"{mlflow_bin} ui --backend-store-uri {cfg.tracking_uri()} --default-artifact-root {root} "
        f"--host {UI_HOST} --port {UI_PORT}"
    )
    models = f"http://{UI_HOST}:{UI_PORT}/#/models?{WORKFLOW_ML}"
    return f"{command}\n  then open {runs_url(cfg, pipeline)}\n  (published versions: {models})"


def runs_url(cfg: TrackingConfig, pipeline: str = "run_all", server: str | None = None) -> str:
    """The UI's runs table of ``pipeline``'s experiment in the embedded store (the experiment list
    when it has no such experiment yet, or for a tracking server, which is not asked: an absent
    one would hold this line for minutes of retries); ``server`` is the UI's address."""
    base = (server or f"http://{UI_HOST}:{UI_PORT}").rstrip("/")
    found = None
    if not cfg.uri and Path(cfg.store).exists():  # (a missing SQLite store is not created by asking)
        found = _experiment(cfg, f"{cfg.experiment_prefix}-{pipeline}")
    if found is None:
        return f"{base}/#/experiments?{WORKFLOW_ML}"
    return f"{base}/#/experiments/{found.experiment_id}/runs?{RUNS_TABLE}"


def _experiment(cfg: TrackingConfig, name: str) -> Any:
    try:
        return MlflowClient(tracking_uri=cfg.tracking_uri()).get_experiment_by_name(name)
    except mlflow.exceptions.MlflowException:  # a store that does not answer: the list still works
        return None


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
        label = f"{stage} {_job.name()}" if _job.space else stage  # a sweep's job: its swept values
        name = f"{label} · {cfg.model.name} · {cfg.experiment_name} · {time.strftime('%m-%d %H:%M:%S')}"
        exp = parent.info.experiment_id if parent else experiment_id(cfg.tracking, pipeline)
        ctx = mlflow.start_run(experiment_id=exp, run_name=name, nested=parent is not None)
    with ctx as run:
        if resume_run_id != run.info.run_id:
            log_config(cfg, stage)
        else:
            mlflow.set_tag("resumed", "true")
        if _job.overrides:
            mlflow.set_tags(_job.tags())
        yield run.info.run_id
        log_metric_histories(run.info.run_id)


@dataclasses.dataclass(frozen=True)
class JobLabel:
    """What the launching job says about itself (the Hydra entry point reads it from Hydra; the
    library never imports Hydra): its command-line overrides, in a sweep (``-m``) the search space
    (each swept key and its sweep, e.g. ``lora.rank: 4,8`` or an Optuna distribution), the sweep's
    folder and this job's number. Every run is tagged ``override.<key>=<value>``; a sweep's job
    runs are named by their swept values (``train_loras lora.rank=4 · ...``) and nest under one
    parent run per sweep (:func:`sweep_parent`)."""

    overrides: dict[str, str] = dataclasses.field(default_factory=dict)
    space: dict[str, str] = dataclasses.field(default_factory=dict)
    sweep: str | None = None  # the sweep's folder (hydra.sweep.dir); None: not a sweep
    job: int = 0  # the job's number in its sweep (Hydra's hydra.job.num): the parent's metric step

    def name(self) -> str:
        return " ".join(f"{k}={self.overrides[k]}" for k in self.space if k in self.overrides)

    def tags(self) -> dict[str, str]:
        return {f"override.{k}": v[:5000] for k, v in self.overrides.items()}


_job = JobLabel()


def label_job(label: JobLabel) -> None:
    """Name and tag the runs this process opens from now on by ``label`` (the entry point's call)."""
    global _job
    _job = label


@contextlib.contextmanager
def sweep_parent(cfg: Config, pipeline: str) -> Iterator[str | None]:
    """In a sweep, the sweep's parent run (made by its first job, found by the sweep's folder by
    the others) as the active run, so that this job's stage run nests under it as a child; yields
    its id. Outside a sweep, inside another run or with tracking off: None."""
    if _job.sweep is None or not cfg.tracking.enabled or mlflow.active_run():
        yield None
        return
    configure(cfg.tracking)
    exp = experiment_id(cfg.tracking, pipeline)
    sweep_id = hashlib.sha256(_job.sweep.encode()).hexdigest()[:16]
    found = MlflowClient().search_runs([exp], f"tags.sweep_id = '{sweep_id}'", max_results=1)
    if found:
        ctx = mlflow.start_run(run_id=found[0].info.run_id)
    else:
        space = ", ".join(f"{k}: {v}" for k, v in _job.space.items())
        tags = {"sweep_id": sweep_id, "sweep_dir": _job.sweep, "stage": "sweep", "sweep.space": space}
        note = f"Sweep of {pipeline} over {space}: one child run per job; metric objective by job number"
        name = f"sweep {pipeline} · {Path(_job.sweep).name}"
        ctx = mlflow.start_run(experiment_id=exp, run_name=name, tags=tags, description=note)
    with ctx as run:
        yield run.info.run_id


def log_sweep_objective(parent: str | None, value: object) -> None:
    """The job's return value (what the sweeper optimises) on the sweep's parent run, at the
    job's number: the parent's ``objective`` curve is the search."""
    if parent and isinstance(value, int | float) and not isinstance(value, bool):
        MlflowClient().log_metric(parent, "objective", float(value), step=_job.job)


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


def log_dataset(
    path: Path,
    name: str,
    sha256: str,
    context: str,
    dataset: Any = None,
    tags: dict[str, str] | None = None,
) -> None:
    """Record one of the run's inputs (a corpus split, the synthetic r1, a pool, an adapter, a
    base's weights) as an MLflow dataset: ``mlflow.log_input`` with our sha256 (or fingerprint)
    as its digest and in full as a tag. ``dataset`` (a HF ``Dataset``) adds its schema and row
    count; without it the input is a meta dataset (source and digest only), which is all an
    input whose contents must not leave the server (the A.2 pool) may be. The one home for this."""
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
        mlflow.log_input(
            ds, context=context, tags={"sha256": sha256, "path": str(path.resolve()), **(tags or {})}
        )


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
