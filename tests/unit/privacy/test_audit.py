"""The one-run user-level audit of DP-FedAvg: its arithmetic (Steinke et al. 2023's p-value and
bound), its validity on the real mechanism (the bound stays under the accounted epsilon) and its
power (without noise it finds a bound of at least 3; an under-noised release is caught)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from nimmer_train.privacy.audit import (
    audit_user_level,
    guess_counts,
    one_run_lower_bound,
    one_run_p_value,
)
from nimmer_train.privacy.dp_fedavg import Mechanism

# a federation small enough for a unit test: 50 ordinary contributors a round, 8 rounds, and
# 1000 canaries of which about 500 take part, each in about a quarter of the rounds
CANARIES, DIM = 1000, 5000


def mechanism(noise_multiplier: float) -> Mechanism:
    return Mechanism(
        population=200, sample_rate=0.25, noise_multiplier=noise_multiplier, clip=1.0, rounds=8, delta=1e-5
    )


def _p_value_as_listed(m: int, r: int, v: int, eps: float, delta: float) -> float:
    """The paper's listing, loop for loop: the reference the vectorised version must match."""
    q = 1 / (1 + np.exp(-eps))
    beta = binom.sf(v - 1, r, q)
    alpha, total = 0.0, 0.0
    for i in range(1, v + 1):
        total += binom.pmf(v - i, r, q)
        if total > i * alpha:
            alpha = total / i
    return min(beta + alpha * delta * 2 * m, 1.0)


@pytest.mark.parametrize(
    ("m", "r", "v", "eps", "delta"),
    [
        (1000, 100, 100, 2.0, 0.0),
        (1000, 100, 90, 1.0, 1e-5),
        (1000, 200, 170, 1.5, 1e-3),
        (50, 10, 3, 0.2, 0.1),
    ],
)
def test_p_value_matches_the_papers_listing(m: int, r: int, v: int, eps: float, delta: float) -> None:
    assert one_run_p_value(m, r, v, eps, delta) == pytest.approx(
        _p_value_as_listed(m, r, v, eps, delta), rel=1e-9
    )


def test_lower_bound_reaches_the_known_ceilings_and_behaves() -> None:
    # all guesses right at 95 %, delta = 0: the ceilings of the reference notes (3.49 for r = 100,
    # 5.81 for r = 1000), i.e. p^r = 0.05 with p = e^eps / (1 + e^eps)
    assert one_run_lower_bound(1000, 100, 100, 0.0) == pytest.approx(np.log(0.05**0.01 / (1 - 0.05**0.01)))
    assert one_run_lower_bound(1000, 100, 100, 0.0) == pytest.approx(3.49, abs=0.01)
    assert one_run_lower_bound(1000, 1000, 1000, 0.0) == pytest.approx(5.81, abs=0.01)
    assert one_run_lower_bound(1000, 100, 50, 0.0) == 0.0  # coin-flip accuracy proves nothing
    # a delta term and more mistakes can only lower the bound
    assert one_run_lower_bound(1000, 100, 100, 1e-4) < one_run_lower_bound(1000, 100, 100, 0.0)
    assert one_run_lower_bound(1000, 100, 90, 1e-5) < one_run_lower_bound(1000, 100, 95, 1e-5)
    with pytest.raises(ValueError, match="correct"):
        one_run_p_value(10, 5, 6, 1.0, 0.0)


def test_the_audit_on_the_real_mechanism_stays_under_the_accounted_epsilon() -> None:
    for z in (0.5, 2.0):
        audit = audit_user_level(mechanism(z), CANARIES, DIM, rng=np.random.default_rng(7))
        assert audit.theoretical_epsilon is not None
        assert 0.0 <= audit.lower_bound <= audit.theoretical_epsilon, audit
        assert audit.guesses in guess_counts(CANARIES, mechanism(z)) and audit.correct <= audit.guesses
    record = audit.record()
    assert record["noise_multiplier"] == 2.0 and record["expected_cohort"] == 50.0
    assert record["lower_bound"] == audit.lower_bound and record["canaries"] == CANARIES


def test_without_noise_the_audit_finds_at_least_three() -> None:
    """The power check: with z = 0 there is no guarantee (epsilon None) and the audit proves eps >= 3."""
    audit = audit_user_level(mechanism(0.0), CANARIES, DIM, rng=np.random.default_rng(0))
    assert audit.theoretical_epsilon is None
    assert audit.lower_bound >= 3.0, audit


def test_an_under_noised_release_is_caught() -> None:
    """A release with a tenth of the accounted noise (z = 0.2 run, z = 2 accounted): the bound passes
    the accounted epsilon, as the check beside every published epsilon would report."""
    accounted = mechanism(2.0).epsilon()
    audit = audit_user_level(mechanism(0.2), CANARIES, DIM, rng=np.random.default_rng(1))
    assert accounted is not None and audit.lower_bound > accounted, (audit.lower_bound, accounted)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="canaries"):
        audit_user_level(mechanism(1.0), canaries=0)
    with pytest.raises(ValueError, match="confidence"):
        audit_user_level(mechanism(1.0), canaries=10, dim=10, confidence=1.5)
