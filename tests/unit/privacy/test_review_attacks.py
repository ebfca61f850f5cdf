"""A review of issue 20's fixes, privacy side: the published epsilons recomputed another way, and
DP-SGD whose rate and divisor can be made independent of the dataset's size (the A.2 pool's,
which its published epsilon used to reveal)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm
from torch.utils.data import DataLoader, TensorDataset

from nimmer_train.config.federated import FederatedConfig, UserDPConfig
from nimmer_train.federation.budget import count_step, planned_a2
from nimmer_train.privacy.accounting import Ledger, Step
from nimmer_train.privacy.dp_sgd import DPConfig, accounted_rate, make_private, public_sample_rate
from tests.unit.privacy.test_dp_guarantees import _lora_model


def _prv(history: list[Step], delta: float) -> float:
    accountant = PRVAccountant()
    accountant.history = history
    return accountant.get_epsilon(delta, eps_error=0.01)


def _gaussian(mu: float, delta: float) -> float:
    """The exact epsilon of a Gaussian mechanism of sensitivity / std ``mu`` at ``delta`` (Balle and
    Wang 2018), in log space (large mu)."""

    def excess(eps: float) -> float:
        a, b = norm.logcdf(-eps / mu + mu / 2), eps + norm.logcdf(-eps / mu - mu / 2)
        return a + math.log1p(-math.exp(min(b - a, -1e-300))) - math.log(delta)

    return brentq(excess, 1e-9, mu * mu + 20 * mu + 20)


def _demo_ledger(settings: FederatedConfig, rounds: int) -> Ledger:
    """The ledger of a federation that released ``rounds`` rounds, one A.2 run each, then the pool
    counts (what the demo's state.json holds)."""
    ledger = Ledger(settings.delta)
    for _ in range(rounds):
        ledger.record(
            (settings.user_dp.noise_multiplier, settings.user_dp.fraction_fit, 1), [planned_a2(settings)]
        )
    ledger.record_release("a2_pool_counts", count_step(settings))
    return ledger


@pytest.mark.parametrize(
    "settings",
    [
        FederatedConfig(user_dp=UserDPConfig(noise_multiplier=0.01)),
        FederatedConfig(),
        FederatedConfig(rounds=10, user_dp=UserDPConfig(noise_multiplier=2.0)),
    ],
    ids=["z=0.01 (the demo before issue 14)", "defaults", "z=2, 10 rounds"],
)
def test_published_epsilons_are_upper_bounds_by_a_second_accountant(settings: FederatedConfig) -> None:
    """Every published epsilon is Opacus's RDP accountant's, and an upper bound on what the PRV
    accountant (and, for A.1 at q = 1, the exact Gaussian mechanism) gives for the same history."""
    warnings.filterwarnings("ignore")
    ledger = _demo_ledger(settings, settings.rounds)
    spent = ledger.spent()
    for name, history in (("a1_user_level", ledger.a1), ("a2_record_level", ledger.a2)):
        rdp = RDPAccountant()
        rdp.history = list(history)
        assert spent[name] == pytest.approx(rdp.get_epsilon(settings.delta), rel=1e-12)
    mu = math.sqrt(settings.rounds) / settings.user_dp.noise_multiplier  # q = 1: T Gaussians compose to one
    assert spent["a1_user_level"] >= _gaussian(mu, settings.delta)
    if settings.user_dp.noise_multiplier >= 0.5:  # PRV's domain: it cannot resolve z = 0.01
        assert spent["a1_user_level"] >= _prv(ledger.a1, settings.delta) - 0.01
    assert spent["a2_record_level"] >= _prv(ledger.a2, settings.delta) - 0.01


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


def test_the_demo_publishes_a_user_level_epsilon_of_at_most_8_at_delta_1e_6() -> None:
    """Issue 14, item 7: `make demo`'s federation is a population that can carry the noise; its
    A.1 guarantee, Opacus RDP over its T Poisson rounds, is at most 8 at delta 1e-6 (and above the
    PRV accountant's figure for the same rounds), and its own budget check passes before round 1."""
    from nimmer_train.federation.budget import mechanism_of, require_budget
    from nimmer_train.federation.checkpoint import ServerState
    from tests.helpers.compose import config

    settings = config("experiment=demo").federated
    assert not settings.no_privacy and settings.delta == 1e-6 and settings.epsilon_budget == 8.0
    mechanism = mechanism_of(settings)
    assert mechanism.population >= 10_000 and mechanism.noise_multiplier >= 0.4
    epsilon = mechanism.epsilon()
    assert epsilon is not None and epsilon <= 8.0
    warnings.filterwarnings("ignore")
    assert epsilon >= _prv([mechanism.step()] * settings.rounds, settings.delta) - 0.01
    require_budget(settings, Ledger(settings.delta, settings.epsilon_budget), ServerState(), True)
