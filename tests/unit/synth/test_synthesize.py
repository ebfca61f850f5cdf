"""The synthesize stage of run_all on the demo seed set: its MLflow run and its data card. The
synthesize pipeline against a teacher over HTTP is in tests/e2e/test_synthesize_pipeline.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers.outputs import synth_dir as _synth_dir

pytestmark = pytest.mark.slow


def test_demo_seed_run_is_tracked_in_mlflow(tiny_run: Path) -> None:
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-run_all")
    (run,) = [r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == "synthesize"]
    metrics = run.data.metrics
    assert metrics["r0"] == 480 and 0 < metrics["r1"] <= 480 and "register_accuracy" in metrics
    assert run.data.tags["teacher_backend"] == "replay"
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"samples.json", "data_card", "manifest.json", "config.yaml"} <= artifacts
    card = (_synth_dir(tiny_run) / "README.md").read_text()
    assert "hand-written seed data" in card and "register_mismatch" in card
