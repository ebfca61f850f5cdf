"""Continued pretraining of a local checkpoint with its own tokenizer (model=pretrained), and
the gemma4_e4b preset's path (bf16 autocast, gradient checkpointing) on a tiny random Gemma 4."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma4TextConfig

from nimmer_train.artifacts import read_manifest
from tests.helpers.pipelines import run_pipeline

pytestmark = pytest.mark.slow

SHORT = (
    "experiment=ci_tiny",
    "train.max_steps=20",
    "train.warmup_steps=2",
    "train.eval_every=20",  # scored before and after only
    "train.synthetic_share=0",  # the literary corpus alone (the mix is tested in test_base_mix.py)
    "tracking.enabled=false",  # nothing here reads MLflow (tiny_run and test_resume.py do)
)


def _published(workdir: Path) -> Path:
    (folder,) = [p for p in (workdir / "artifacts/base").iterdir() if not p.name.startswith(".")]
    return folder


def _with_tiny_run_corpus(tiny_run: Path, workdir: Path) -> Path:
    """``workdir`` holding tiny_run's ingested corpus (the same config: found, not ingested again)."""
    shutil.copytree(tiny_run / "artifacts/corpus", workdir / "artifacts/corpus")
    return workdir


def test_continue_from_a_trained_base(tiny_run: Path, tmp_path: Path) -> None:
    source = _published(tiny_run)
    before = read_manifest(source)["lineage"]["metrics"]
    work = _with_tiny_run_corpus(tiny_run, tmp_path / "work")
    run_pipeline(
        "build_base", work, *SHORT, "train.lr=5e-4", "model=pretrained", f"model.name_or_path={source}"
    )
    after = read_manifest(_published(work))["lineage"]["metrics"]
    # it starts from the trained weights (not random: untrained ppl is ~1000) and keeps learning
    assert after["initial_val_ppl"] == pytest.approx(before["final_val_ppl"], rel=0.05)
    assert after["final_val_ppl"] < after["initial_val_ppl"]


def test_gemma4_preset_trains_in_bf16_with_checkpointing(tiny_run: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(_published(tiny_run))
    config = Gemma4TextConfig(
        vocab_size=len(tokenizer),
        vocab_size_per_layer_input=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        sliding_window=32,
        hidden_size_per_layer_input=16,
        layer_types=["sliding_attention", "full_attention"],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
    )
    checkpoint = tmp_path / "gemma4-tiny"
    AutoModelForCausalLM.from_config(config).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    work = _with_tiny_run_corpus(tiny_run, tmp_path / "work")
    run_pipeline(
        "build_base",
        work,
        *SHORT,
        "train.eval_batches=4",  # a stratified sample, the same blocks before and after (bf16 is slow)
        "model=gemma4_e4b",
        f"model.name_or_path={checkpoint}",
    )
    folder = _published(work)
    metrics = read_manifest(folder)["lineage"]["metrics"]
    assert metrics["final_val_ppl"] < metrics["initial_val_ppl"]
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "gemma4_text"
