"""build_base as 2 CPU processes (DDP over gloo under torchrun): one model folder, one run, and
a validation figure over every block that one process reproduces on the same model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from datasets import load_from_disk
from mlflow.tracking import MlflowClient
from transformers import AutoModelForCausalLM, AutoTokenizer

from nimmer_train.artifacts import read_manifest, verify_manifest
from nimmer_train.base.pretrain import evaluate, pack_blocks
from nimmer_train.config import TrainConfig
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
        "train.eval_every=40",  # scored before and after only
        "train.synthetic_share=0",  # the literary corpus alone (the mix is tested in test_base_mix.py)
        "corpus.include=[plato_apology]",  # one work: a few dozen validation blocks to score, twice
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

    # the 2-process figure is over every validation block: one process gets it again (issue 22)
    lineage = read_manifest(folder)["lineage"]
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = load_from_disk(lineage["dataset_dir"])["validation"]["text"]
    ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
    blocks = pack_blocks(ids, tokenizer.eos_token_id, lineage["train"]["seq_len"])
    assert metrics["validation_blocks"] == len(blocks) and lineage["train"]["eval_batches"] is None
    model = AutoModelForCausalLM.from_pretrained(folder)
    cfg = TrainConfig(**lineage["train"])
    with torch.no_grad():
        one = evaluate(model, blocks, cfg, Accelerator(cpu=True))
    assert one == pytest.approx(metrics["final_val_loss"], rel=1e-5)
