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
    assert 0 <= parent.data.metrics["separability.r1.utterance"] <= 1
    assert "mean_gain.r1.utterance" in parent.data.metrics
    files = {a.path for a in client.list_artifacts(parent.info.run_id, "evaluation")}
    assert files >= {
        "evaluation/heldout_loss_r1_utterance.csv",
        "evaluation/heldout_loss_r1_format.csv",
        "evaluation/heldout_loss_r0_utterance.csv",
        "evaluation/heldout_loss_matrix.png",
        "evaluation/summary.json",
        "evaluation/samples.json",
    }
    csv = Path(
        client.download_artifacts(parent.info.run_id, "evaluation/heldout_loss_r1_utterance.csv")
    ).read_text()
    header, *rows = csv.strip().splitlines()
    assert header.split(",") == ["data", "n", "tokens", "base", *TWO] and len(rows) == 2


def test_own_adapters_win_on_utterance_tokens_of_heldout_scenes(tiny_run: Path) -> None:
    """ci_tiny trains two very different registers for 40 steps, scored on utterance tokens of
    scenes neither adapter saw. The honest figures are small (issue 22): the gain over the base is
    0.030 [0.022, 0.038] nats/token (0.36 over all reply tokens, which mostly measured the JSON
    format), drunk-scavenger's own adapter wins by a clear margin (+0.08), hivemind-broadcast's
    by +0.010 [0.001, 0.020], which is within noise. So this asserts the clear win, a gain whose
    interval excludes zero, and that the format dominates the all-token gain; not separability 1.0."""
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-run_all")
    (parent,) = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == "train_loras"
    ]
    m = parent.data.metrics
    assert m["margin.r1.utterance.drunk-scavenger_low"] > 0.03  # the clear win, on r1 and on r0
    assert m["margin.r0.utterance.drunk-scavenger_low"] > 0.03
    assert m["separability.r1.utterance"] >= 0.5
    assert m["mean_gain.r1.utterance_low"] > 0  # the adapters carry some voice, not only format
    assert m["mean_gain.r1.format"] > 10 * m["mean_gain.r1.utterance"]


def test_half_written_checkpoints_are_not_resumed_from(tmp_path: Path) -> None:
    for step, complete in ((4, True), (8, True), (12, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        (folder / "adapter_model.safetensors").write_bytes(b"x")
        if complete:
            (folder / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    assert latest_complete_checkpoint(tmp_path) == tmp_path / "checkpoint-8"
    assert not (tmp_path / "checkpoint-12").exists()
