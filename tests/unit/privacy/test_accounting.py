"""Privacy accounting: matches Opacus's accountant, survives a restart, stops at the budget; the
published epsilons hold when recomputed by a second accountant, and without Opacus."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import numpy as np
import pytest
import yaml
from opacus.accountants import PRVAccountant, RDPAccountant
from scipy.optimize import brentq
from scipy.special import logsumexp
from scipy.stats import norm

from nimmer_train.config.federated import FederatedConfig, UserDPConfig
from nimmer_train.federation.budget import count_step, mechanism_of, planned_a2, require_budget
from nimmer_train.federation.checkpoint import ServerState
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, Step, epsilon
from tests.helpers import REPO
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


DEMO = REPO / "conf" / "experiment" / "demo.yaml"


def _log_moment(q: float, z: float, order: float) -> float:
    """log E_{x ~ N(0, z^2)}[((1 - q) + q exp((2x - 1) / (2 z^2)))^order], on a fine grid."""
    x = np.linspace(-40 * z, order + 40 * z + 1, 200_001)
    ratio = np.logaddexp(math.log1p(-q), math.log(q) + (2 * x - 1) / (2 * z * z))
    log_f = order * ratio - x * x / (2 * z * z) - math.log(z * math.sqrt(2 * math.pi))
    return float(logsumexp(log_f) + math.log(x[1] - x[0]))


def _epsilon_by_integration(z: float, q: float, rounds: int, delta: float) -> float:
    """RDP of T sampled Gaussians, converted as Balle et al. 2020 (what Opacus uses)."""
    orders = [1.5 + i / 20 for i in range(170)]
    return min(
        rounds * _log_moment(q, z, a) / (a - 1)
        + math.log1p(-1 / a)
        - (math.log(delta) + math.log(a)) / (a - 1)
        for a in orders
    )


class TestPublishedEpsilonsRecomputed:
    """Reviews of issues 14 and 20 recomputed the published epsilons another way: with a second
    accountant, and without Opacus (the sampled Gaussian's Renyi divergence integrated numerically
    from the demo preset's N, q, z, T, delta)."""

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

    def test_the_demo_publishes_at_most_8_at_delta_1e_6_recomputed_without_opacus(self) -> None:
        fed = yaml.safe_load(DEMO.read_text())["federated"]
        user = fed["user_dp"]
        n = user.get("population_size") or fed["simulation"]["contributors"] + 1
        z, q, rounds, delta = user["noise_multiplier"], user["fraction_fit"], fed["rounds"], fed["delta"]
        assert n == 10_000 and delta == pytest.approx(1e-6) and fed["epsilon_budget"] <= 8
        mine = _epsilon_by_integration(z, q, rounds, delta)
        ledger = epsilon([(z, q, rounds)], delta)
        assert ledger is not None and mine <= 8.0 and ledger <= 8.0
        assert ledger == pytest.approx(mine, abs=0.01)  # Opacus's grid of orders is a little coarser
