"""Plain local SGD reuses one loaded model for every node a simulation process hosts
(local_training.reusable_trainable). A node that fails after its backward pass (a worker's fault
between backward and the optimizer's zero_grad) must leave nothing in that model: its gradients,
left on the shared parameters, would be added to the next node's first step, and the next
contributor's update would carry the failed contributor's data (two contributions from one
user's data: the user-level sensitivity C no longer holds)."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from nimmer_train.federation.local_training import load_trainable, train_locally
from nimmer_train.federation.wire import get_arrays
from tests.unit.federation.test_local_training import PLAIN_SGD, node_texts


def test_a_node_failing_mid_step_leaks_no_gradient_into_the_next_node(
    release: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nimmer_train.federation import local_training

    base, adapter = release
    warnings.filterwarnings("ignore")
    start = get_arrays(load_trainable(base, adapter)[0])
    recipe, failed, second = PLAIN_SGD, node_texts(11), node_texts(12)
    local_training._LOADED.clear()
    alone = train_locally(base, adapter, start, second, recipe, tmp_path / "a.json", 1e-5)

    local_training._LOADED.clear()

    def failing_step(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        raise RuntimeError("drill: this node fails after its backward pass")

    with monkeypatch.context() as patch:
        patch.setattr(torch.optim.SGD, "step", failing_step)
        with pytest.raises(RuntimeError, match="drill"):
            train_locally(base, adapter, start, failed, recipe, tmp_path / "b.json", 1e-5)
    after = train_locally(base, adapter, start, second, recipe, tmp_path / "c.json", 1e-5)
    assert all(np.array_equal(a, b) for a, b in zip(alone.arrays, after.arrays, strict=True))
