"""lora.dtype=bfloat16 (the demo's): the register LoRAs' held-out losses are computed under
bfloat16 autocast over float32 weights, close to the float32 figures; float32 is untouched."""

from __future__ import annotations

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nimmer_train.loras.train import compute_autocast, token_losses
from tests.helpers.compose import config


def _tiny() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg).eval()


def _batch() -> list[dict[str, list[int]]]:
    rng = np.random.default_rng(0)
    rows = []
    for n in (12, 20, 7):
        ids = rng.integers(1, 64, n).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 3 + ids[3:]})
    return rows


def test_bfloat16_losses_are_close_to_float32_and_float32_is_exact() -> None:
    model = _tiny()
    seen: list[torch.dtype] = []
    hook = model.model.layers[0].mlp.down_proj.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    exact = token_losses(model, _batch(), pad_id=0)  # no torch.no_grad() here: token_losses has its own
    again = token_losses(model, _batch(), pad_id=0, dtype="float32")
    bf16 = token_losses(model, _batch(), pad_id=0, dtype="bfloat16")
    hook.remove()
    assert seen[0] == torch.float32 and seen[-1] == torch.bfloat16  # the matmuls ran in bfloat16
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the weights stayed float32
    for a, b, c in zip(exact, again, bf16, strict=True):
        assert np.array_equal(np.isnan(a), np.isnan(c)) and np.array_equal(a, b, equal_nan=True)
        assert np.nanmax(np.abs(a - c)) < 0.1  # a few hundredths of a nat at most
        assert c.dtype == np.float64


def test_autocast_is_off_for_float32() -> None:
    model = _tiny()
    with compute_autocast(model, "float32"):
        assert not torch.is_autocast_enabled("cpu")
    with compute_autocast(model, "bfloat16"):
        assert torch.is_autocast_enabled("cpu")


def test_the_demo_computes_in_bfloat16_and_the_tiny_presets_in_float32() -> None:
    demo = config("experiment=demo")
    assert demo.model.dtype == demo.lora.dtype == "bfloat16"
    for preset in ("tiny", "ci_tiny"):
        cfg = config(f"experiment={preset}")
        assert cfg.model.dtype == cfg.lora.dtype == "float32"
