"""Sweeps as an engineer runs them (``-m``): each job's MLflow run is named by its swept values
and tagged with its overrides, and the jobs of one sweep are the children of one parent run; the
Optuna sweeper (conf/hparams_search/lora_gain.yaml) searches the LoRAs against the held-out
utterance gain that train_loras returns, in a real MLflow SQLite store."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.helpers.outputs import base_dir
from tests.helpers.pipelines import run_pipeline

pytestmark = pytest.mark.slow


def _runs(workdir: Path, pipeline: str) -> tuple[object, list]:
    """(the sweep's parent run, its child runs oldest first) in ``pipeline``'s experiment."""
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    exp = client.get_experiment_by_name(f"nimmer-{pipeline}")
    runs = client.search_runs([exp.experiment_id], order_by=["attributes.start_time ASC"])
    (parent,) = [r for r in runs if r.data.tags.get("stage") == "sweep"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    return parent, children


def test_basic_sweep_names_and_tags_each_job_run_by_its_overrides(tmp_path: Path, corpus_dir: Path) -> None:
    run_pipeline(
        "ingest",
        tmp_path,
        "hydra.mode=MULTIRUN",  # `-m`, which argparse takes only before the first override
        "corpus.chunk_chars=1500,2000",
        "corpus.include=[plato_apology]",
    )
    parent, children = _runs(tmp_path, "ingest")
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["sweep.space"] == "corpus.chunk_chars: 1500,2000"
    assert [r.info.run_name.split(" · ")[0] for r in children] == [
        "ingest corpus.chunk_chars=1500",
        "ingest corpus.chunk_chars=2000",
    ]
    for run, chunk in zip(children, ("1500", "2000"), strict=True):
        assert run.data.tags["override.corpus.chunk_chars"] == chunk
        assert run.data.tags["override.corpus.include"] == "[plato_apology]"
        assert run.data.params["corpus.chunk_chars"] == chunk  # the tag says what the job ran


def test_optuna_study_is_a_parent_run_with_one_child_per_trial(tiny_run: Path, tmp_path: Path) -> None:
    (tmp_path / "artifacts").mkdir()
    for inputs in ("corpus", "synth"):  # tiny_run's corpus and r1 (same fingerprints): reused
        (tmp_path / "artifacts" / inputs).symlink_to(tiny_run / "artifacts" / inputs)
    run_pipeline(
        "train_loras",
        tmp_path,
        "+hparams_search=lora_gain",  # (a multirun by itself: hydra.mode=MULTIRUN)
        "experiment=ci_tiny",
        f"lora.base_dir={base_dir(tiny_run)}",
        "hydra.sweeper.n_trials=2",
        "lora.max_steps=choice(2,3)",  # the command line narrows the config's search space
        "lora.eval_max_examples=4",
        "lora.sample_max_new_tokens=4",
    )
    parent, trials = _runs(tmp_path, "train_loras")
    assert parent.info.status == "FINISHED" and len(trials) == 2
    assert "lora.max_steps: choice(2,3)" in parent.data.tags["sweep.space"]
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    objective = sorted(client.get_metric_history(parent.info.run_id, "objective"), key=lambda m: m.step)
    assert [m.step for m in objective] == [0, 1]
    for trial, point in zip(trials, objective, strict=True):
        tags = trial.data.tags
        swept = " ".join(f"{k}={tags[f'override.{k}']}" for k in ("lora.rank", "lora.lr", "lora.max_steps"))
        assert trial.info.run_name.split(" · ")[0] == f"train_loras {swept}"
        assert tags["override.lora.max_steps"] in ("2", "3") and int(tags["override.lora.rank"]) in (4, 8, 16)
        assert trial.data.params["lora.rank"] == tags["override.lora.rank"]  # what the trial ran
        # the value Optuna got is the trial's own held-out utterance gain
        assert point.value == pytest.approx(trial.data.metrics["mean_gain.r1.utterance"])
    (results,) = (tmp_path / "multirun" / "train_loras").glob("*/optimization_results.yaml")
    assert yaml.safe_load(results.read_text())["best_value"] == pytest.approx(max(m.value for m in objective))
