"""Register LoRAs on experiment=ci_tiny: plain-peft loading, base binding and refusal, the
evaluation matrix in MLflow, all adapters on one base, checkpoints, separability. The train_loras
pipeline runs (skip, resume, QLoRA refusal) are in tests/e2e/test_loras_pipeline.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from mlflow.tracking import MlflowClient
from peft import PeftModel
from transformers import AutoModelForCausalLM

from nimmer_train.artifacts import write_manifest
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import METADATA, base_identity, check_binding, load_all
from nimmer_train.loras.train import latest_complete_checkpoint
from tests.helpers.outputs import adapters as _adapters
from tests.helpers.outputs import only as _only

pytestmark = pytest.mark.slow
TWO = ("hivemind-broadcast", "drunk-scavenger")


def test_adapters_load_with_plain_peft_and_are_bound_to_their_base(tiny_run: Path, tmp_path: Path) -> None:
    base_dir = _only(tiny_run / "artifacts/base")
    adapters = _adapters(tiny_run)
    assert set(adapters) == set(TWO)
    for name, folder in adapters.items():
        assert {"adapter_config.json", "adapter_model.safetensors", METADATA} <= {
            p.name for p in folder.iterdir()
        }
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir), folder)
        assert any("lora_A" in n for n, _ in model.named_parameters())
        meta = json.loads((folder / METADATA).read_text())
        assert meta["register"] == name and meta["traits"]["Sophrosyne"] != 0
        assert meta["base"] == base_identity(base_dir)
        assert set(meta["datasets"]) == {"synth", "corpus"} and meta["training_config_hash"]
        assert meta["metrics"]["steps"] == 40

    other = tmp_path / "other-base"
    shutil.copytree(base_dir, other)
    weights = other / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4] + b"\x00\x00\x00\x01")
    (other / "manifest.json").unlink()
    write_manifest(other, "base", "f" * 64, {})
    folder = adapters["hivemind-broadcast"]
    with pytest.raises(NimmerError, match=rf"trained on base {base_dir.name} .*not on other-base"):
        check_binding(folder, other)
    assert check_binding(folder, other, allow_other_base=True)["register"] == "hivemind-broadcast"


def test_all_adapters_on_one_base_switch_per_call(tiny_run: Path) -> None:
    base_dir = _only(tiny_run / "artifacts/base")
    model = load_all(base_dir, list(_adapters(tiny_run).values()))
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    outputs = {}
    with torch.no_grad():
        for name in TWO:
            model.set_adapter(name)
            outputs[name] = model(input_ids=ids).logits
        with model.disable_adapter():
            outputs["base"] = model(input_ids=ids).logits
    assert not torch.allclose(outputs[TWO[0]], outputs[TWO[1]])
    assert not torch.allclose(outputs[TWO[0]], outputs["base"])


def test_evaluation_matrix_and_runs_in_mlflow(tiny_run: Path) -> None:
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-run_all")
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("stage") == "train_loras"]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.params["register"] for r in children) == sorted(TWO)
    for child in children:
        assert len(client.get_metric_history(child.info.run_id, "train_loss")) >= 2
    assert 0 <= parent.data.metrics["separability"] <= 1 and "mean_loss_gain" in parent.data.metrics
    files = {a.path for a in client.list_artifacts(parent.info.run_id, "evaluation")}
    assert files >= {
        "evaluation/heldout_loss_matrix.csv",
        "evaluation/heldout_loss_matrix.png",
        "evaluation/samples.json",
    }
    csv = Path(
        client.download_artifacts(parent.info.run_id, "evaluation/heldout_loss_matrix.csv")
    ).read_text()
    header, *rows = csv.strip().splitlines()
    assert header.split(",") == ["data", "base", *TWO] and len(rows) == 2


def test_diagonal_wins_on_clearly_separable_registers(tiny_run: Path) -> None:
    """ci_tiny trains two clearly different registers for 40 steps: each adapter wins on its own data."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-run_all")
    (parent,) = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == "train_loras"
    ]
    assert parent.data.metrics["separability"] == 1.0
    assert parent.data.metrics["mean_loss_gain"] > 0.1


def test_half_written_checkpoints_are_not_resumed_from(tmp_path: Path) -> None:
    for step, complete in ((4, True), (8, True), (12, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"x")
        if complete:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-8"
    assert not (tmp_path / "checkpoint-12").exists()
