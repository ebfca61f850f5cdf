"""The federated adapter's held-out gain over the adapter it started from, with an interval.

The server's held-out set (:func:`nimmer_train.memory.synthetic.heldout_examples`, drawn in its
own seed namespace: no contributor's data) is scored token by token under the start adapter and
under the federated one; the gain is the token-weighted mean loss before minus after, in nats per
token, on every token of each line (the federation's examples are plain ``speaker: text`` lines,
all utterance: there are no format tokens to leave out). Its interval is a paired
percentile bootstrap over the held-out examples (each resample draws examples with replacement and
takes both losses of the same examples), the examples being independent draws of the generator.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from nimmer_train.loras.evaluation import BOOTSTRAP_SAMPLES, CONFIDENCE


def example_losses(
    model: Any, rows: list[dict[str, list[int]]], pad_id: int
) -> tuple[np.ndarray, np.ndarray]:
    """Per held-out example: the sum of its token losses and its scored tokens (model in eval)."""
    from nimmer_train.loras.train import token_losses

    was_training = model.training
    model.eval()
    try:
        losses = token_losses(model, rows, pad_id)
    finally:
        model.train(was_training)
    sums = np.array([np.nansum(x) for x in losses])
    counts = np.array([int(np.sum(~np.isnan(x))) for x in losses])
    return sums, counts


def paired_gain(before: np.ndarray, after: np.ndarray, tokens: np.ndarray, seed: int = 0) -> dict[str, Any]:
    """Token-weighted gain (before - after) / tokens with its paired bootstrap interval over examples."""
    total = float(tokens.sum())
    gain = float((before.sum() - after.sum()) / total)
    rng = np.random.default_rng(seed)
    picks = rng.integers(0, len(tokens), size=(BOOTSTRAP_SAMPLES, len(tokens)))
    resampled = (before[picks].sum(1) - after[picks].sum(1)) / tokens[picks].sum(1)
    tail = (1 - CONFIDENCE) / 2
    low, high = np.quantile(resampled, [tail, 1 - tail])
    return {
        "gain": gain,
        "low": float(low),
        "high": float(high),
        "confidence": CONFIDENCE,
        "bootstrap_samples": BOOTSTRAP_SAMPLES,
        "resampled": "held-out examples (paired)",
        "examples": len(tokens),
        "tokens": int(total),
        "heldout_loss_before": float(before.sum() / total),
        "heldout_loss_after": float(after.sum() / total),
    }


def federated_gain(
    model: Any, start: list[np.ndarray], rows: list[dict[str, list[int]]], pad_id: int
) -> dict[str, Any]:
    """The gain of the model's current adapter over ``start`` (the arrays it started from) on
    ``rows``; the model's adapter is left as it was found."""
    from nimmer_train.federation.wire import get_arrays, set_arrays

    final = get_arrays(model)
    after, tokens = example_losses(model, rows, pad_id)
    set_arrays(model, start)
    try:
        before, _ = example_losses(model, rows, pad_id)
    finally:
        set_arrays(model, final)
    return paired_gain(before, after, tokens)
