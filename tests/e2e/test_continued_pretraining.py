"""Continued pretraining of a local checkpoint with its own tokenizer (model=pretrained), and
the gemma4_e4b preset's path (bf16 autocast, gradient checkpointing) on a tiny random Gemma 4."""

from __future__ import annotations

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
    "train.eval_every=10",
    "train.synthetic_share=0",  # the literary corpus alone (the mix is tested in test_base_mix.py)
)


def _published(workdir: Path) -> Path:
    (folder,) = [p for p in (workdir / "artifacts/base").iterdir() if not p.name.startswith(".")]
    return folder


def test_continue_from_a_trained_base(tiny_run: Path, tmp_path: Path) -> None:
    source = _published(tiny_run)
    before = read_manifest(source)["lineage"]["metrics"]
    run_pipeline(
        "build_base", tmp_path, *SHORT, "train.lr=5e-4", "model=pretrained", f"model.name_or_path={source}"
    )
    after = read_manifest(_published(tmp_path))["lineage"]["metrics"]
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
    run_pipeline(
        "build_base", tmp_path / "work", *SHORT, "model=gemma4_e4b", f"model.name_or_path={checkpoint}"
    )
    folder = _published(tmp_path / "work")
    metrics = read_manifest(folder)["lineage"]["metrics"]
    assert metrics["final_val_ppl"] < metrics["initial_val_ppl"]
    assert AutoModelForCausalLM.from_pretrained(folder).config.model_type == "gemma4_text"
