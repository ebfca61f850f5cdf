"""The published user-level audit runs the server's own aggregation (issue 43): it audited
``dp_fedavg``'s arithmetic, not the ``NoisyMean`` that releases a round, so a defect in how the
server sums a round (one client's forged weight scaling every honest update) could not move it.
Each audited round now goes through ``NoisyMean.aggregate_fit`` on the clients' clipped
contributions; the audit of that path catches noise applied at a tenth of the accounted z and a
strategy whose sum is scaled, and the card says what canary count would decide the published
epsilon when the audit cannot.

Sizes, measured (1000 canaries, dim 5000, q = 0.25, T = 8, accounted z = 2: epsilon 2.08; seeds
1 and 2): noise at z / 10 gives 3.65 on both; a sum scaled 16x gives 3.65, 4x 1.56 and 1.18, 2x
0.46 and 0.17. A one-run audit of this size cannot see a 2x forged weight (its guard is the
round's weight check in ``strategy.py``); it sees the server's aggregation, which the old audit
did not run at all."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from nimmer_train.config.federated import FederatedConfig, SimulationConfig, UserDPConfig
from nimmer_train.federation import results
from nimmer_train.federation.strategy import NoisyMean
from nimmer_train.federation.strategy_audit import AGGREGATOR, audit_aggregator
from nimmer_train.privacy.audit import best_provable_bound, canaries_to_decide
from nimmer_train.privacy.dp_fedavg import Mechanism
from nimmer_train.publish.card import _report_lines

SETTINGS = FederatedConfig(min_participants=1)


def mechanism(z: float) -> Mechanism:
    return Mechanism(population=200, sample_rate=0.25, noise_multiplier=z, clip=1.0, rounds=8, delta=1e-5)


class ScaledSum(NoisyMean):
    """The server's strategy with every round's sum scaled 16x, the noise unchanged: what a
    client's forged SecAgg+ weight does to the release (issue 43, finding 11, reproduced at 16x)."""

    def _sum(self, results: list[Any]) -> list[np.ndarray]:
        return [16.0 * a for a in super()._sum(results)]


@pytest.fixture(autouse=True)
def _quiet_flower() -> Any:
    """Flower warns about min_available_clients once per strategy built."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    yield
    logger.setLevel(level)


def test_the_audit_of_the_servers_aggregator_catches_noise_applied_at_a_tenth() -> None:
    accounted = mechanism(2.0).epsilon()
    audit = audit_aggregator(SETTINGS, mechanism(0.2), canaries=1000, dim=5000, rng=np.random.default_rng(1))
    assert audit.aggregator == AGGREGATOR
    assert accounted is not None and audit.lower_bound > accounted, (audit.lower_bound, accounted)


def test_a_scaled_sum_in_the_servers_strategy_is_caught_and_the_honest_one_is_not() -> None:
    accounted = mechanism(2.0).epsilon()
    assert accounted is not None
    forged = audit_aggregator(
        SETTINGS, mechanism(2.0), ScaledSum, canaries=1000, dim=5000, rng=np.random.default_rng(2)
    )
    honest = audit_aggregator(SETTINGS, mechanism(2.0), canaries=1000, dim=5000, rng=np.random.default_rng(2))
    assert forged.lower_bound > accounted >= honest.lower_bound, (forged.lower_bound, honest.lower_bound)
    assert forged.aggregator.endswith("ScaledSum")


def _demo_like(noise: float) -> FederatedConfig:
    return FederatedConfig(
        rounds=3,
        delta=1e-6,
        epsilon_budget=None,
        user_dp=UserDPConfig(fraction_fit=0.004, noise_multiplier=noise),
        simulation=SimulationConfig(contributors=9999),
    )


def test_an_inconclusive_audit_says_what_canary_count_would_decide() -> None:
    """At the demo's q T = 0.012 with 1000 canaries the best provable epsilon is 0. At z = 1
    (epsilon 1.06) 8000 canaries could pass it; at the demo's z = 0.45 (epsilon 6.09) no count
    up to the limit can (the delta term 2 m delta grows with m): the card says which."""
    report = results.audit_report(_demo_like(1.0), 3)
    assert report is not None and report["audit_conclusive"] is False
    assert report["aggregator"] == AGGREGATOR and "NoisyMean" in report["method"]
    m = report["audit_canaries_to_decide"]
    mech = Mechanism(
        population=10_000, sample_rate=0.004, noise_multiplier=1.0, clip=1.0, rounds=3, delta=1e-6
    )
    eps = report["theoretical_epsilon"]
    assert m == 8000 and best_provable_bound(m, mech, 0.95) > eps >= best_provable_bound(m // 2, mech, 0.95)
    text = "\n".join(_report_lines({"a1_mechanism": mech.describe(), "audit": report}))
    assert (
        f"inconclusive: at this sampling rate too few canaries take part for the audit to see a leak at "
        f"all; at 1,000 canaries the best provable epsilon is 0.00; m >= 8,000 canaries would decide "
        f"epsilon <= {eps:.2f}"
    ) in text, text
    demo = dict(
        report, audit_canaries_to_decide=canaries_to_decide(Mechanism(10_000, 0.004, 0.45, 1.0, 3, 1e-6))
    )
    text = "\n".join(_report_lines({"a1_mechanism": mech.describe(), "audit": demo}))
    assert demo["audit_canaries_to_decide"] is None
    assert "no canary count up to 4,096,000 could test the published epsilon (raise q T)" in text
