"""The shared DP-FedAvg arithmetic (issue 14, item 1): Poisson cohorts, the fixed denominator,
the noise calibrated to it, the budget refused before round 1, and the noise multiplier that
spends a target epsilon."""

from __future__ import annotations

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from nimmer_train.privacy.accounting import BudgetExceeded
from nimmer_train.privacy.dp_fedavg import (
    Mechanism,
    aggregate,
    clip_update,
    noise_multiplier_for,
    poisson_cohort,
    release,
    release_arrays,
)

MECHANISM = Mechanism(population=1000, sample_rate=0.02, noise_multiplier=0.9, clip=2.0, rounds=5, delta=1e-6)


def test_poisson_cohorts_vary_in_size_around_q_n() -> None:
    rng = np.random.default_rng(1)
    sizes = [len(poisson_cohort(1000, 0.02, rng)) for _ in range(400)]
    assert np.mean(sizes) == pytest.approx(20, abs=1.0)  # sd of the mean 0.22
    assert np.std(sizes) == pytest.approx(np.sqrt(1000 * 0.02 * 0.98), rel=0.15)
    cohort = poisson_cohort(1000, 0.02, rng)
    assert len(set(cohort.tolist())) == len(cohort) and cohort.max() < 1000
    assert len(poisson_cohort(50, 1.0, rng)) == 50  # q = 1: everyone


def test_the_release_divides_by_q_n_whoever_answered() -> None:
    """Half the cohort gone: the same denominator q N = 20 and the same noise z C / (q N)."""
    updates = [np.full(8, 3.0)] * 10  # norm 8.5 each: clipped to C = 2
    released = aggregate(updates, MECHANISM, np.random.default_rng(7))
    expected = (sum(clip_update(u, 2.0) for u in updates) + np.random.default_rng(7).normal(0, 1.8, 8)) / 20
    assert np.allclose(released, expected, atol=1e-12)
    noise = [release(np.zeros(2000), MECHANISM, np.random.default_rng(s)) for s in range(5)]
    assert np.std(noise) == pytest.approx(MECHANISM.noise_std, rel=0.02)
    assert MECHANISM.noise_std == pytest.approx(0.9 * 2.0 / 20)
    # a list of tensors is one Gaussian vector over all of them, in their shapes
    parts = release_arrays([np.ones((2, 3)), np.ones(4)], MECHANISM, np.random.default_rng(3))
    flat = release(np.ones(10), MECHANISM, np.random.default_rng(3))
    assert parts[0].shape == (2, 3) and np.allclose(np.concatenate([p.ravel() for p in parts]), flat)


def test_epsilon_is_opacus_rdp_with_one_step_per_round() -> None:
    accountant = RDPAccountant()
    for _ in range(5):
        accountant.step(noise_multiplier=0.9, sample_rate=0.02)
    assert MECHANISM.epsilon() == pytest.approx(accountant.get_epsilon(delta=1e-6), rel=1e-12)
    described = MECHANISM.describe()
    assert described["accountant"] == "opacus.rdp" and described["sampling"] == "poisson"
    assert described["expected_cohort"] == pytest.approx(20) and described["population"] == 1000


def test_a_budget_the_rounds_cannot_fit_is_refused_before_round_1_naming_epsilon() -> None:
    spent = MECHANISM.epsilon()
    assert MECHANISM.require(spent + 0.01) == pytest.approx(spent)
    with pytest.raises(BudgetExceeded, match=rf"would spend user-level epsilon {spent:.3f} over 5 rounds"):
        MECHANISM.require(spent - 0.01)


@pytest.mark.parametrize(("target", "rate", "rounds"), [(8.0, 0.005, 3), (3.0, 0.01, 20), (1.0, 0.001, 50)])
def test_the_calibrated_noise_spends_at_most_the_target(target: float, rate: float, rounds: int) -> None:
    z = noise_multiplier_for(target, rate, rounds, 1e-6)
    at = Mechanism(10_000, rate, z, 1.0, rounds, 1e-6).epsilon()
    below = Mechanism(10_000, rate, z - 2e-3, 1.0, rounds, 1e-6).epsilon()
    assert at is not None and below is not None and at <= target < below
