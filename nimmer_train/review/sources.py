"""Where one workdir's records live, and the MLflow reads every review module shares."""

from __future__ import annotations

import functools
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from nimmer_train.errors import NimmerError


@dataclass(frozen=True)
class Sources:
    """A workdir (what ``paths.workdir`` was), its tracking store and its releases folder."""

    workdir: Path
    tracking_uri: str
    releases: Path
    prefix: str = "nimmer"

    def client(self) -> MlflowClient:
        return MlflowClient(tracking_uri=self.tracking_uri)


def sources(
    workdir: str | Path = ".",
    tracking_uri: str | None = None,
    releases_dir: str | Path | None = None,
    prefix: str = "nimmer",
) -> Sources:
    """The sources of ``workdir``: its embedded store ``mlflow.db`` unless ``tracking_uri`` is given."""
    root = Path(workdir).resolve()
    if tracking_uri is None:
        db = root / "mlflow.db"
        if not db.exists():
            raise NimmerError(
                f"no MLflow store at {db}: run `make demo` (or `python -m pipelines.run_all "
                f"paths.workdir={root}`) first, or pass tracking_uri"
            )
        tracking_uri = f"sqlite:///{db}"
    releases = Path(releases_dir).resolve() if releases_dir else root / "releases"
    return Sources(root, tracking_uri, releases, prefix)


def runs(src: Sources, stage: str | None = None, pipeline: str | None = None) -> list[Run]:
    """Runs newest first: of one stage (the ``stage`` tag), in one pipeline's experiment or all."""
    client = src.client()
    if pipeline:
        found = client.get_experiment_by_name(f"{src.prefix}-{pipeline}")
        experiments = [found.experiment_id] if found else []
    else:
        experiments = [e.experiment_id for e in client.search_experiments()]
    if not experiments:
        return []
    where = f"tags.stage = '{stage}'" if stage else ""
    return client.search_runs(experiments, where, max_results=1000, order_by=["attributes.start_time DESC"])


def last_run(src: Sources, stage: str, pipeline: str | None = None) -> Run:
    """The newest run of ``stage``; a clear error when there is none."""
    found = runs(src, stage, pipeline)
    if not found:
        raise NimmerError(
            f"no {stage!r} run in {src.tracking_uri}: run the pipeline that makes it "
            f"(`python -m pipelines.run_all paths.workdir={src.workdir}`)"
        )
    return found[0]


def children(src: Sources, parent: Run) -> list[Run]:
    """Every run nested under ``parent`` (depth first, in start order)."""
    client = src.client()
    found = client.search_runs(
        [parent.info.experiment_id],
        f"tags.mlflow.parentRunId = '{parent.info.run_id}'",
        max_results=1000,
        order_by=["attributes.start_time ASC"],
    )
    out: list[Run] = []
    for run in found:
        out += [run, *children(src, run)]
    return out


@functools.cache
def _downloads() -> tempfile.TemporaryDirectory[str]:
    """Where artifact copies go: removed when the process (the notebook's kernel) exits."""
    return tempfile.TemporaryDirectory(prefix="nimmer-review-")


def artifact(src: Sources, run: Run, path: str) -> Path | None:
    """A local copy of one artifact of ``run`` (None when the run did not log it)."""
    import mlflow.artifacts

    listed = {a.path for a in src.client().list_artifacts(run.info.run_id, str(Path(path).parent))}
    if path not in listed:
        return None
    target = Path(tempfile.mkdtemp(dir=_downloads().name))
    return Path(
        mlflow.artifacts.download_artifacts(
            run_id=run.info.run_id, artifact_path=path, dst_path=str(target), tracking_uri=src.tracking_uri
        )
    )


def artifact_json(src: Sources, run: Run, path: str) -> Any:
    local = artifact(src, run, path)
    return None if local is None else json.loads(local.read_text())


def artifact_text(src: Sources, run: Run, path: str) -> str | None:
    local = artifact(src, run, path)
    return None if local is None else local.read_text()


def history(src: Sources, run: Run, keys: list[str] | None = None) -> pd.DataFrame:
    """Metric histories as a long table: metric, step, value (every metric when ``keys`` is None)."""
    client = src.client()
    rows = [
        {"metric": key, "step": m.step, "value": m.value}
        for key in (keys if keys is not None else sorted(run.data.metrics))
        for m in client.get_metric_history(run.info.run_id, key)
    ]
    return pd.DataFrame(rows, columns=["metric", "step", "value"]).sort_values(["metric", "step"])


def seconds(run: Run) -> float | None:
    if run.info.end_time is None:
        return None
    return (run.info.end_time - run.info.start_time) / 1000
