"""The quantized engine keeps each register LoRA's prompt KV across turns under other LoRAs:
switching back decodes only the prompt's new tail, and the logits it gives agree with decoding
the whole prompt cold under that LoRA (the parked KV is that LoRA's own, never another's)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nimmer_train.runtime.quantized_model import QuantizedModel
from nimmer_train.voice.prompt_dsl import render_compact
from tests.unit.runtime.test_quantized_ring_a import _prompt


def _tail_decoded(model: QuantizedModel, prompt: list[int], register: str) -> tuple[np.ndarray, int]:
    """The logits after ``prompt`` under ``register`` and how many prompt tokens were decoded."""
    decoded: list[int] = []
    original = model.context._decode

    def counting(tokens: list[int]) -> np.ndarray:
        decoded.append(len(tokens))
        return original(tokens)

    model.context._decode = counting  # type: ignore[method-assign]
    try:
        return model.context.prefill(prompt, register), sum(decoded)
    finally:
        del model.context._decode


def test_a_register_switched_back_decodes_only_its_new_tail_with_the_same_logits(
    published: tuple[Path, Path],
) -> None:
    releases, trusted = published
    model = QuantizedModel.open(releases, "v1", trusted, "q8_0", threads=1)
    try:
        first, other = model.registers[:2]
        base = model.prompt_ids(render_compact(_prompt(first)[0]))
        longer = [*base, *model.tokenizer.encode(" And the ring?", add_special_tokens=False)]
        model.context.prefill(base, first)
        model.context.prefill(model.prompt_ids(render_compact(_prompt(other)[0])), other)
        warm, decoded = _tail_decoded(model, longer, first)
        assert decoded == len(longer) - len(base)
        model.context.park_kv = False  # the cold path: a switch drops the KV
        model.context.prefill(base, other)
        cold, decoded = _tail_decoded(model, longer, first)
        assert decoded == len(longer)
        np.testing.assert_allclose(warm, cold, rtol=0, atol=1e-2 * float(np.abs(cold).max()))
        assert int(warm.argmax()) == int(cold.argmax())
    finally:
        model.close()
