"""build_base as 2 CPU processes (DDP over gloo under torchrun): one model folder, one run."""

from __future__ import annotations

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM

from nimmer_train.artifacts import read_manifest, verify_manifest
from tests.helpers.pipelines import run_pipeline

pytestmark = pytest.mark.slow


def test_torchrun_two_processes(tmp_path: Path) -> None:
    run_pipeline(
        "build_base",
        tmp_path,
        "experiment=ci_tiny",
        "train.launcher=torchrun",
        "train.nproc=2",
        "train.max_steps=40",
        "train.eval_every=20",
    )
    (folder,) = [p for p in (tmp_path / "artifacts/base").iterdir() if not p.name.startswith(".")]
    assert verify_manifest(folder) == []
    metrics = read_manifest(folder)["lineage"]["metrics"]
    assert metrics["processes"] == 2
    assert metrics["final_val_ppl"] < metrics["initial_val_ppl"]
    assert AutoModelForCausalLM.from_pretrained(folder).config.hidden_size == 64

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-build_base")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.params["train.nproc"] == "2"
    assert len(client.get_metric_history(run.info.run_id, "train_loss")) == 8  # rank 0 only
