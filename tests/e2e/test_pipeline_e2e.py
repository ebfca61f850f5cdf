"""End to end on experiment=ci_tiny: ingest then build_base under run_all, read back from MLflow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from nimmer_train.artifacts import read_manifest, verify_manifest

pytestmark = pytest.mark.slow


def _client(workdir: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")


def _base_dir(workdir: Path) -> Path:
    (found,) = [p for p in (workdir / "artifacts/base").iterdir() if not p.name.startswith(".")]
    return found


def test_trained_perplexity_is_well_below_untrained(tiny_run: Path) -> None:
    metrics = read_manifest(_base_dir(tiny_run))["lineage"]["metrics"]
    print(f"validation perplexity {metrics['initial_val_ppl']:.1f} -> {metrics['final_val_ppl']:.1f}")
    assert metrics["final_val_ppl"] / metrics["initial_val_ppl"] < 0.5
    assert metrics["steps"] == 100 and metrics["processes"] == 1


def test_model_folder_is_standard_and_verified(tiny_run: Path) -> None:
    folder = _base_dir(tiny_run)
    names = {p.name for p in folder.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "manifest.json"} <= names
    assert verify_manifest(folder) == []
    lineage = read_manifest(folder)["lineage"]
    assert {"config_hash", "git_commit", "dataset_fingerprint"} <= set(lineage)
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok("Socrates said", return_tensors="pt").input_ids
    with torch.no_grad():
        assert math.isfinite(model(input_ids=ids, labels=ids).loss.item())
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    original = (folder / "config.json").read_text()
    (folder / "config.json").write_text(original + " ")
    try:
        assert verify_manifest(folder) == ["config.json"]
    finally:  # other tests publish this base
        (folder / "config.json").write_text(original)


def test_mlflow_holds_nested_runs_with_params_metrics_artifacts(tiny_run: Path) -> None:
    client = _client(tiny_run)
    exp = client.get_experiment_by_name("nimmer-run_all")
    runs = client.search_runs([exp.experiment_id])
    parent = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parent) == 1
    children = {
        r.data.tags["stage"]: r
        for r in runs
        if r.data.tags.get("mlflow.parentRunId") == parent[0].info.run_id
    }
    assert len(parent) == 1
    assert {"ingest", "synthesize", "build_base", "train_loras"} <= set(children)
    assert all(r.data.tags["mlflow.parentRunId"] == parent[0].info.run_id for r in children.values())
    assert all(r.info.status == "FINISHED" for r in runs)

    base = children["build_base"]
    assert base.info.run_name.startswith("build_base · tiny · ci_tiny")
    assert base.data.params["model.hidden_size"] == "64" and base.data.params["train.max_steps"] == "100"
    assert base.data.tags["git_commit"] and base.data.tags["dataset_fingerprint"]
    history = client.get_metric_history(base.info.run_id, "train_loss")
    assert len(history) == 20 and history[0].step == 5  # logged as training went, every 5 steps
    val = client.get_metric_history(base.info.run_id, "val_ppl")
    assert [m.step for m in val] == [0, 50, 100]
    artifacts = {a.path for a in client.list_artifacts(base.info.run_id)}
    assert {"config.yaml", "manifest.json"} <= artifacts
    inputs = base.inputs.dataset_inputs
    assert {i.dataset.name for i in inputs} == {"literary-train", "literary-validation"}
    sha = {t.key: t.value for t in inputs[0].tags}["sha256"]
    assert len(sha) == 64 and sha.startswith(inputs[0].dataset.digest)

    ingest = children["ingest"]
    assert ingest.data.metrics["works"] == 3
    assert "data_card" in {a.path for a in client.list_artifacts(ingest.info.run_id)}
    manifest = json.loads(Path(client.download_artifacts(ingest.info.run_id, "manifest.json")).read_text())
    assert manifest["kind"] == "corpus"
