"""A node's local training (federation/local_training.py, the A.2 node's DP-SGD through
Contributor.fit) says nothing it should not and takes every step it accounts (issues 20 and its
review): its noise cannot be recomputed from anything the server knows; the A.2 node's accounting
step is the one the settings fix, whatever its pool's size (Opacus's rate 1 / ceil(n / 16) moved
with one example at a boundary, 48 -> 49, and the published A.2 epsilon told the pool's size); an
empty Poisson batch still takes the noisy step."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
from opacus.utils.uniform_sampler import UniformWithReplacementSampler

from nimmer_train.config.federated import FederatedConfig, LocalDPConfig, LocalRecipeConfig
from nimmer_train.federation import budget, rounds
from nimmer_train.federation.client import Contributor, Node, example_text
from nimmer_train.federation.local_training import LocalTrainingConfig, load_trainable, train_locally
from nimmer_train.federation.strategy import fit_config
from nimmer_train.federation.wire import A2_KEY_ID, A2_METRICS, A2_NONCE, a2_key_id, get_arrays
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.a2_pool import A2Pool, claim_key
from nimmer_train.privacy.anonymize import anonymize


def test_a_nodes_update_cannot_be_recomputed_from_the_server_configuration(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Item 2: everything the server knows (global adapter, recipe, seed), even the node's own
    texts, run twice: two different updates. Before, the seed fixed the noise and the masks."""
    base, adapter = release
    warnings.filterwarnings("ignore")
    model, _ = load_trainable(base, adapter)
    arrays = get_arrays(model)
    texts = [example_text(e) for e in heldout_examples(24, seed=5)]
    recipe = LocalTrainingConfig(
        LocalRecipeConfig(steps=2, batch_size=8, lr=3.0, max_length=32, max_examples=64),
        LocalDPConfig(noise_multiplier=1.0, max_grad_norm=0.1, grad_sample_mode="hooks"),
        seed=7,
    )
    one = train_locally(base, adapter, arrays, texts, recipe, tmp_path / "one.json", 1e-5)
    two = train_locally(base, adapter, arrays, texts, recipe, tmp_path / "two.json", 1e-5)
    assert not all(np.array_equal(a, b) for a, b in zip(one.arrays, two.arrays, strict=True))


def _pool(folder: Path, examples: int) -> Path:
    """An A.2 intake of two uploads (k = 2) holding ``examples`` examples in all."""
    path = folder / f"pool-{examples}" / "a2_pool.sqlite"
    pool = A2Pool(path, 2)
    rows = [
        {
            "speaker": "npc:oran",
            "text": f"the ferry bell rang {i} times at dusk",
            "data_category": "casual_dialog",
        }
        for i in range(examples)
    ]
    half = examples // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pool.add(anonymize(part, f"player-{i}", f"Name{i}"))
    pool.close()
    claim_key(path, create=True)  # as the server started with this pool writes it
    return path


@pytest.mark.usefixtures("quiet")
def test_the_a2_nodes_accounting_step_does_not_depend_on_the_pools_size(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Before: Opacus's rate 1 / ceil(n / 16) was reported and published through the A.2 epsilon,
    so one example at a boundary (48 -> 49) changed it with certainty. After: every pool size gives
    the step the settings fix, the only one the server accepts."""
    base, adapter = release
    settings = FederatedConfig(local=LocalRecipeConfig(steps=2, max_length=24))
    model, _ = load_trainable(base, adapter)
    arrays = get_arrays(model)
    config = {**fit_config(settings, rounds.spec_of(model)), "round": 1}
    steps = set()
    for examples in (48, 49, 300):  # 300: beyond max_examples (256), every example is still used
        node = Node(base, adapter, a2_pool=_pool(tmp_path, examples))
        # the round's claim nonce and key id, as NoisyMean sends them to a server's own A.2 node
        claims = {A2_NONCE: "n", A2_KEY_ID: a2_key_id(claim_key(node.a2_pool))}  # type: ignore[arg-type]
        _, _, metrics = Contributor(node).fit(arrays, {**config, **claims})
        steps.add(tuple(metrics[k] for k in A2_METRICS))
    assert len(steps) == 1 and steps == {budget.planned_a2(settings)}  # before: 1/3, 1/4, 1/16
    assert budget.planned_a2(settings)[1] == 1 / 16  # batch_size / max_examples, whatever the pool


@pytest.mark.usefixtures("quiet")
def test_an_empty_poisson_batch_still_takes_the_noisy_step(
    release: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an empty batch was accounted but skipped, so the weights did not move exactly when
    no record was drawn (and a run of empty batches failed the lora_changed check). After: the
    noise-only step Opacus's optimizer takes, accounted."""

    def nothing_drawn(self: UniformWithReplacementSampler):  # noqa: ANN202
        for _ in range(self.steps):
            yield []

    monkeypatch.setattr(UniformWithReplacementSampler, "__iter__", nothing_drawn)
    base, adapter = release
    model, _ = load_trainable(base, adapter)
    arrays = get_arrays(model)
    recipe = LocalTrainingConfig(
        LocalRecipeConfig(steps=3, batch_size=4, lr=3.0, max_length=24, max_examples=64),
        LocalDPConfig(noise_multiplier=1.0, max_grad_norm=0.1, grad_sample_mode="hooks"),
        seed=0,
    )
    texts = [example_text(e) for e in heldout_examples(16, seed=4)]  # rate 1/4, expected batch 4
    result = train_locally(base, adapter, arrays, texts, recipe, tmp_path / "acc.json", 1e-5)
    moved = [np.abs(a - b).max() for a, b in zip(result.arrays, arrays, strict=True)]
    assert max(moved) > 0 and result.steps == 3 and result.epsilon and result.epsilon > 0
    # each step's noise on the mean: std z * clip / expected batch = 1.0 * 0.1 / 4; lr 3 -> 0.075
    delta = np.concatenate([(a - b).ravel() for a, b in zip(result.arrays, arrays, strict=True)])
    assert delta.std() == pytest.approx(0.075 * math.sqrt(3), rel=0.1)


PLAIN_SGD = LocalTrainingConfig(
    LocalRecipeConfig(steps=2, batch_size=4, lr=1.0, max_length=32, max_examples=8),
    LocalDPConfig(),
    seed=3,
    private=False,
)  # a simulated node's plain local SGD (local_dp.on_devices=false): the shared-model path


def node_texts(seed: int) -> list[str]:
    """One simulated node's training lines."""
    return [example_text(e) for e in heldout_examples(8, seed=seed)]


def test_nodes_sharing_a_process_train_as_if_each_were_alone(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Plain local SGD reuses one loaded model for every node a simulation process hosts: a node
    trained after another (other arrays, other texts) gets exactly the update it gets in a fresh
    process, and the model of the first node leaks nothing into the second."""
    from nimmer_train.federation import local_training

    base, adapter = release
    warnings.filterwarnings("ignore")
    start = get_arrays(load_trainable(base, adapter)[0])
    moved = [a + np.float32(0.01) for a in start]
    recipe, first, second = PLAIN_SGD, node_texts(11), node_texts(12)
    local_training._LOADED.clear()
    alone = train_locally(base, adapter, start, second, recipe, tmp_path / "a.json", 1e-5)
    local_training._LOADED.clear()
    train_locally(base, adapter, moved, first, recipe, tmp_path / "b.json", 1e-5)
    (held,) = local_training._LOADED.values()
    after = train_locally(base, adapter, start, second, recipe, tmp_path / "c.json", 1e-5)
    assert next(iter(local_training._LOADED.values()))[0] is held[0]  # not loaded again
    assert all(np.array_equal(a, b) for a, b in zip(alone.arrays, after.arrays, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(start, after.arrays, strict=True))
