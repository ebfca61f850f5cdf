"""Privacy accounting: matches Opacus's accountant, survives a restart, stops at the budget; the
published epsilons hold when recomputed by a second accountant."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.optimize import brentq
from scipy.stats import norm

from nimmer_train.config.federated import FederatedConfig, UserDPConfig
from nimmer_train.federation.budget import count_step, mechanism_of, planned_a2, require_budget
from nimmer_train.federation.checkpoint import ServerState
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, Step
from tests.helpers.compose import config


def test_epsilon_matches_an_independent_opacus_computation(tmp_path: Path) -> None:
    ledger = Ledger(delta=1e-5)
    for _ in range(3):
        ledger.record(a1=(1.1, 0.5, 1), a2=[(0.9, 0.05, 40)])
    independent_a1, independent_a2 = RDPAccountant(), RDPAccountant()
    for _ in range(3):
        independent_a1.step(noise_multiplier=1.1, sample_rate=0.5)
        for _ in range(40):
            independent_a2.step(noise_multiplier=0.9, sample_rate=0.05)
    spent = ledger.spent()
    assert spent["a1_user_level"] == pytest.approx(independent_a1.get_epsilon(delta=1e-5), rel=1e-9)
    assert spent["a2_record_level"] == pytest.approx(independent_a2.get_epsilon(delta=1e-5), rel=1e-9)
    first, last = ledger.rounds[0], ledger.rounds[-1]
    assert first["epsilon_a1_user_level_this_round"] == first["epsilon_a1_user_level"] > 0
    assert last["epsilon_a2_record_level"] > first["epsilon_a2_record_level"]

    ledger.save(tmp_path / "ledger.json")
    again = Ledger.load(tmp_path / "ledger.json", delta=1e-5, budget=None)
    assert again.spent() == spent and again.rounds == ledger.rounds


def test_budget_stops_before_the_round_that_would_exceed_it() -> None:
    ledger = Ledger(delta=1e-5, budget=3.0)
    completed = 0
    with pytest.raises(BudgetExceeded, match=r"round \d+ would spend epsilon .* > budget 3.0"):
        while True:
            ledger.plan(a1=(1.5, 0.2, 1))
            ledger.record(a1=(1.5, 0.2, 1))
            completed += 1
    assert completed == 11 and ledger.spent()["a1_user_level"] <= 3.0 and len(ledger.rounds) == completed


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


class TestPublishedEpsilonsRecomputed:
    """A review of issue 20's fixes recomputed the published epsilons another way."""

    @pytest.mark.parametrize(
        "settings",
        [
            FederatedConfig(user_dp=UserDPConfig(noise_multiplier=0.01)),
            FederatedConfig(),
            FederatedConfig(rounds=10, user_dp=UserDPConfig(noise_multiplier=2.0)),
        ],
        ids=["z=0.01 (the demo before issue 14)", "defaults", "z=2, 10 rounds"],
    )
    def test_published_epsilons_are_upper_bounds_by_a_second_accountant(
        self, settings: FederatedConfig
    ) -> None:
        """Every published epsilon is Opacus's RDP accountant's, and an upper bound on what the PRV
        accountant (and, for A.1 at q = 1, the exact Gaussian mechanism) gives for the same history."""
        warnings.filterwarnings("ignore")
        ledger = _demo_ledger(settings, settings.rounds)
        spent = ledger.spent()
        for name, history in (("a1_user_level", ledger.a1), ("a2_record_level", ledger.a2)):
            rdp = RDPAccountant()
            rdp.history = list(history)
            assert spent[name] == pytest.approx(rdp.get_epsilon(settings.delta), rel=1e-12)
        # q = 1: T Gaussians compose to one
        mu = math.sqrt(settings.rounds) / settings.user_dp.noise_multiplier
        assert spent["a1_user_level"] >= _gaussian(mu, settings.delta)
        if settings.user_dp.noise_multiplier >= 0.5:  # PRV's domain: it cannot resolve z = 0.01
            assert spent["a1_user_level"] >= _prv(ledger.a1, settings.delta) - 0.01
        assert spent["a2_record_level"] >= _prv(ledger.a2, settings.delta) - 0.01

    def test_the_demo_publishes_a_user_level_epsilon_of_at_most_8_at_delta_1e_6(self) -> None:
        """Issue 14, item 7: `make demo`'s federation is a population that can carry the noise; its
        A.1 guarantee, Opacus RDP over its T Poisson rounds, is at most 8 at delta 1e-6 (and above the
        PRV accountant's figure for the same rounds), and its own budget check passes before round 1."""
        settings = config("experiment=demo").federated
        assert not settings.no_privacy and settings.delta == 1e-6 and settings.epsilon_budget == 8.0
        mechanism = mechanism_of(settings)
        assert mechanism.population >= 10_000 and mechanism.noise_multiplier >= 0.4
        epsilon = mechanism.epsilon()
        assert epsilon is not None and epsilon <= 8.0
        warnings.filterwarnings("ignore")
        assert epsilon >= _prv([mechanism.step()] * settings.rounds, settings.delta) - 0.01
        require_budget(settings, Ledger(settings.delta, settings.epsilon_budget), ServerState(), True)
