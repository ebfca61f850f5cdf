"""A build_base killed with SIGKILL resumes from its checkpoint and ends at the same loss."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from nimmer_train.artifacts import read_manifest
from tests.helpers.pipelines import kill_when, run_pipeline

pytestmark = pytest.mark.slow

OVERRIDES = ("experiment=ci_tiny",)  # the same build as tiny_run's, which is the uninterrupted reference


def _manifest(workdir: Path) -> dict:
    (base,) = [p for p in (workdir / "artifacts/base").iterdir() if not p.name.startswith(".")]
    return read_manifest(base)


def _metrics(workdir: Path) -> dict:
    return _manifest(workdir)["lineage"]["metrics"]


def _weights_sha(workdir: Path) -> str:
    return next(f["sha256"] for f in _manifest(workdir)["files"] if f["path"] == "model.safetensors")


def test_sigkill_then_resume_matches_uninterrupted(tiny_run: Path, tmp_path: Path) -> None:
    straight, killed = tiny_run, tmp_path / "killed"
    for corpus in ("corpus", "synth"):  # tiny_run's inputs, found by fingerprint (not built again)
        shutil.copytree(tiny_run / "artifacts" / corpus, killed / "artifacts" / corpus)

    kill_when(
        "build_base",
        killed,
        *OVERRIDES,
        ready=lambda: bool(list((killed / "artifacts/base").glob(".work-*/checkpoints/step-000040"))),
    )
    published = [p for p in (killed / "artifacts/base").iterdir() if not p.name.startswith(".")]
    assert published == []  # no half-written model is visible

    run_pipeline("build_base", killed, *OVERRIDES)
    a, b = _metrics(straight), _metrics(killed)
    assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], rel=1e-6)
    assert b["final_val_loss"] == pytest.approx(a["final_val_loss"], rel=1e-6)
    assert _weights_sha(killed) == _weights_sha(straight)  # deterministic on CPU: same bytes

    client = MlflowClient(tracking_uri=f"sqlite:///{killed / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-build_base")
    (run,) = client.search_runs([exp.experiment_id])  # the resumed run continued, not a second one
    assert run.data.tags.get("resumed") == "true" and run.info.status == "FINISHED"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps[-1] == 100
