"""The record-level guarantees hold as stated (issue 20): a record's per-sample gradient does not
depend on the other records of its batch (items 3), DP-SGD's noise and Poisson masks do not come
from a seed anyone can set (item 2), DP-SGD's rate and divisor need not move with the dataset's
size (which a published epsilon would reveal), the ledger accounts every A.2 mechanism of a round (item 6)
and gives no epsilon for a mechanism without noise (item 7), and the A.2 pool's counts leave the
server only noised (item 1)."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from opacus import GradSampleModule
from opacus.accountants import RDPAccountant
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from nimmer_train.base.modeling import build_model
from nimmer_train.config import ModelConfig
from nimmer_train.privacy.a2_pool import COUNT_SENSITIVITY, A2Pool, noised_counts
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, epsilon
from nimmer_train.privacy.anonymize import anonymize
from nimmer_train.privacy.dp_sgd import (
    DPConfig,
    accounted_rate,
    lm_loss,
    make_private,
    opacus_sample_rate,
    public_sample_rate,
)

VOCAB = 256


def _lora_model(seed: int = 0) -> torch.nn.Module:
    model = build_model(
        ModelConfig(
            name="tiny",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        VOCAB,
        0,
        1,
        seed=seed,
    )
    return get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )


def _batch(other_length: int, width: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    """Record 0 (10 tokens) and record 1 (``other_length`` tokens), right-padded, pads -100."""
    rng = torch.Generator().manual_seed(3)
    ids = torch.full((2, width), 1)
    labels = torch.full((2, width), -100)
    for row, length in enumerate((10, other_length)):
        tokens = torch.randint(2, VOCAB, (length,), generator=rng if row == 0 else None)
        ids[row, :length] = tokens
        labels[row, :length] = tokens
    return ids, labels


def _per_sample_grads(other_length: int) -> dict[str, torch.Tensor]:
    """Record 0's per-sample gradients from Opacus's hooks, in a batch beside a record of length
    ``other_length``."""
    model = GradSampleModule(_lora_model().train())  # Opacus's default "hooks" mode, mean reduction
    ids, labels = _batch(other_length)
    lm_loss(model, ids, labels).backward()
    return {n: p.grad_sample[0].clone() for n, p in model.named_parameters() if p.requires_grad}


def test_a_records_gradient_does_not_depend_on_the_other_records_length() -> None:
    """Item 3: with a token mean over the whole batch the gradient of record 0 was scaled by B/T
    (T: valid tokens of the batch), so its clipped contribution changed with record 1's length."""
    short, long = _per_sample_grads(other_length=3), _per_sample_grads(other_length=22)
    assert short.keys() == long.keys() and short
    for name in short:
        assert torch.allclose(short[name], long[name], rtol=1e-5, atol=1e-7), name
    norm = math.sqrt(sum(float(g.pow(2).sum()) for g in short.values()))
    assert norm > 0


def test_ghost_mode_averages_tokens_per_record_the_same_way() -> None:
    """Ghost clipping's criterion wrapper and the hooks loss give each record the same loss."""
    warnings.filterwarnings("ignore")
    ids, labels = _batch(other_length=5)
    model = _lora_model()
    private = make_private(
        model,
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
        DataLoader(TensorDataset(ids, labels), batch_size=2),
        DPConfig(grad_sample_mode="ghost"),
    )
    ghost = lm_loss(private.model, ids, labels, private.criterion).loss_per_sample
    with torch.no_grad():
        hooks = [float(lm_loss(private.model, ids[i : i + 1], labels[i : i + 1])) for i in range(2)]
    assert ghost.detach().tolist() == pytest.approx(hooks, rel=1e-5)


def _one_private_step(model_seed: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Poisson batches drawn and the LoRA weights after one DP-SGD step, after seeding torch with
    the value a server would send."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)  # what the old client did with the server's seed
    model = _lora_model(model_seed)
    data = TensorDataset(torch.randint(0, VOCAB, (64, 12), generator=torch.Generator().manual_seed(1)))
    private = make_private(
        model,
        torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5),
        DataLoader(data, batch_size=16),
        DPConfig(noise_multiplier=1.0),
    )
    masks = [list(batch) for batch in private.loader.batch_sampler]
    (x,) = next(iter(DataLoader(data, batch_size=16)))
    lm_loss(private.model, x, x).backward()
    private.optimizer.step()
    return masks, [p.detach().clone() for n, p in private.model.named_parameters() if "lora_" in n]


def test_dp_noise_and_poisson_masks_do_not_follow_the_configured_seed() -> None:
    """Item 2: the same torch seed, the same model, the same data: different sampling masks and
    different noise, because both come from generators seeded from the OS's entropy."""
    masks_one, weights_one = _one_private_step(model_seed=0)
    masks_two, weights_two = _one_private_step(model_seed=0)
    assert masks_one != masks_two
    assert not all(torch.equal(a, b) for a, b in zip(weights_one, weights_two, strict=True))


def test_the_planned_a2_rate_is_the_one_opacus_accounts() -> None:
    """Item 5's trigger: for 93 batches Opacus's DPDataLoader has int(1 / (1 / 93)) = 92."""
    warnings.filterwarnings("ignore")
    for examples in (93, 186, 40, 3):
        model = _lora_model()
        private = make_private(
            model,
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            DataLoader(TensorDataset(torch.zeros(examples, 4, dtype=torch.long)), batch_size=1),
            DPConfig(),
        )
        assert opacus_sample_rate(examples, 1) == 1 / len(private.loader), examples
    assert opacus_sample_rate(93, 1) == 1 / 92


def test_a_public_rate_and_divisor_do_not_depend_on_the_datasets_size() -> None:
    """Opacus's defaults sample at 1 / len(loader) and divide by int(len(dataset) * rate): both move
    with one record (48 -> 49 records in batches of 16: rate 1/3 -> 1/4, divisor 16 -> 12). With
    DPConfig's sample_rate and expected_batch_size neither does."""
    warnings.filterwarnings("ignore")

    def private(records: int, settings: DPConfig) -> tuple[float, float]:
        model = _lora_model()
        data = TensorDataset(torch.zeros(records, 4, dtype=torch.long))
        p = make_private(
            model,
            torch.optim.SGD([q for q in model.parameters() if q.requires_grad], lr=0.1),
            DataLoader(data, batch_size=16),
            settings,
        )
        return 1 / len(p.loader), p.optimizer.expected_batch_size

    default = {records: private(records, DPConfig()) for records in (48, 49)}
    assert default[48] != default[49]
    rate = public_sample_rate(16, 256)
    fixed = {
        records: private(records, DPConfig(sample_rate=rate, expected_batch_size=16))
        for records in (48, 49, 300)
    }
    assert set(fixed.values()) == {(accounted_rate(rate), 16)} and accounted_rate(rate) == 1 / 16


def test_every_a2_mechanism_of_a_round_is_accounted() -> None:
    """Item 6: two A.2 runs in one round and the pool counts' release all count."""
    ledger = Ledger(delta=1e-5)
    ledger.record((1.0, 1.0, 1), [(1.0, 0.25, 6), (0.8, 0.5, 6)])
    ledger.record_release("a2_pool_counts", (5.0, 1.0, 1))
    independent = RDPAccountant()
    for noise, rate, steps in [(1.0, 0.25, 6), (0.8, 0.5, 6), (5.0, 1.0, 1)]:
        for _ in range(steps):
            independent.step(noise_multiplier=noise, sample_rate=rate)
    assert ledger.spent()["a2_record_level"] == pytest.approx(independent.get_epsilon(delta=1e-5), rel=1e-9)


def test_a_mechanism_without_noise_has_no_epsilon() -> None:
    """Item 7: z = 0 gives no guarantee: None, never an infinite epsilon in a JSON record."""
    assert epsilon([(0.0, 1.0, 2)], 1e-5) is None
    ledger = Ledger(delta=1e-5, budget=100.0)
    with pytest.raises(BudgetExceeded, match="inf > budget"):
        ledger.plan((0.0, 1.0, 1))
    assert Ledger(delta=1e-5).record((0.0, 1.0, 1))["epsilon_a1_user_level"] is None


def test_pool_counts_leave_only_noised_with_every_category(tmp_path: Path) -> None:
    """Item 1: the pool's uploads and per-category counts are released with Gaussian noise of std
    z * sqrt(2); every listed category is released (a zero one too), so no name gives one away."""
    pool = A2Pool(tmp_path / "a2.sqlite", k=5)  # below k: the counts are still the whole pool's
    for i in range(3):
        pool.add(anonymize([{"text": f"line {i}", "data_category": "lore"}], f"p{i}", f"n{i}"))
    pool.close()
    categories = ["lore", "quest", "chat"]
    rng = np.random.default_rng(11)  # seeded: the means below are 4-standard-error checks
    draws = [noised_counts(tmp_path / "a2.sqlite", 5, categories, 2.0, rng) for _ in range(400)]
    assert all(set(d["categories"]) == {*categories, "unknown"} for d in draws)
    uploads = np.array([d["uploads"] for d in draws])
    lore = np.array([d["categories"]["lore"] for d in draws])
    quest = np.array([d["categories"]["quest"] for d in draws])
    assert len(set(uploads.tolist())) == len(draws)  # no two releases alike: noise on every figure
    std = 2.0 * COUNT_SENSITIVITY
    assert draws[0]["noise_std"] == pytest.approx(std)
    assert abs(uploads.mean() - 3) < 4 * std / 20 and abs(lore.mean() - 3) < 4 * std / 20
    assert abs(quest.mean()) < 4 * std / 20 and 0.8 * std < quest.std() < 1.2 * std
