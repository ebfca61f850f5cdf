"""The federated adapter's held-out gain over the adapter it started from comes with a paired
bootstrap interval over the server's held-out examples (issue 38 #3): the point figure is the
same token-weighted loss difference the round loop reports, the interval holds it, the model
keeps its federated adapter, and an adapter that did not move gains exactly 0."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nimmer_train.config.federated import LocalDPConfig, LocalRecipeConfig
from nimmer_train.federation import results
from nimmer_train.federation.client import example_text
from nimmer_train.federation.gain import paired_gain
from nimmer_train.federation.local_training import (
    LocalTrainingConfig,
    encode_rows,
    load_trainable,
    sgd_locally,
)
from nimmer_train.federation.wire import get_arrays, set_arrays
from nimmer_train.loras.train import heldout_loss
from nimmer_train.memory.synthetic import heldout_examples


def _rows(tokenizer, seed: int, n: int) -> list[dict[str, list[int]]]:  # noqa: ANN001
    return encode_rows(tokenizer, [example_text(e) for e in heldout_examples(n, seed=seed)], 48)


def test_the_gain_over_the_start_adapter_has_a_paired_interval(release: tuple[Path, Path]) -> None:
    base, adapter = release
    model, tokenizer = load_trainable(base, adapter)
    start = get_arrays(model)
    texts = [example_text(e) for e in heldout_examples(32, seed=7)]
    trained, _ = sgd_locally(
        model,
        tokenizer,
        start,
        texts,
        LocalTrainingConfig(LocalRecipeConfig(lr=1.0, steps=4), LocalDPConfig(), seed=0, private=False),
    )
    set_arrays(model, trained)
    rows = _rows(tokenizer, 11, 24)
    model.eval()
    after = heldout_loss(model, rows, tokenizer.pad_token_id)
    gain = results.heldout_gain(model, adapter, (rows, tokenizer.pad_token_id))
    set_arrays(model, start)
    before = heldout_loss(model, rows, tokenizer.pad_token_id)
    assert gain["heldout_loss_before"] == pytest.approx(before, abs=1e-6)
    assert gain["heldout_loss_after"] == pytest.approx(after, abs=1e-6)
    assert gain["gain"] == pytest.approx(before - after, abs=1e-6) and gain["gain"] != 0
    assert gain["low"] <= gain["gain"] <= gain["high"] and gain["low"] < gain["high"]
    assert gain["examples"] == len(rows) and gain["resampled"] == "held-out examples (paired)"
    set_arrays(model, trained)
    results.heldout_gain(model, adapter, (rows, tokenizer.pad_token_id))
    assert all(np.array_equal(a, b) for a, b in zip(get_arrays(model), trained, strict=True))


def test_an_adapter_that_did_not_move_gains_zero_with_a_zero_interval() -> None:
    losses = np.array([3.0, 5.0, 4.0, 2.5])
    out = paired_gain(losses, losses.copy(), np.array([3, 5, 4, 2]))
    assert out["gain"] == 0 and out["low"] == 0 and out["high"] == 0
