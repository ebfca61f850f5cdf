"""The federation's privacy budget: which steps its mechanisms take, and whether they fit.

Every mechanism's step is a function of the settings only: the user-level (A.1) round
(:func:`mechanism_of`), the A.2 node's DP-SGD run (:func:`planned_a2`, never of the pool's size)
and the noised release of the pool's counts (:func:`count_step`). The budget of all remaining
rounds is checked before round 1 (:func:`require_budget`), each round's before it runs
(:func:`plan_round`, the pool counts' step kept in reserve), and the pool's counts are released
once the rounds end, if the budget still allows it (:func:`release_pool_counts`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.checkpoint import ServerState
from nimmer_train.memory.consent import NEVER_SHARED
from nimmer_train.memory.entries import DATA_CATEGORIES
from nimmer_train.privacy.a2_pool import claim_key, noised_counts
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, Step
from nimmer_train.privacy.dp_fedavg import Mechanism
from nimmer_train.privacy.dp_sgd import accounted_rate, public_sample_rate

log = logging.getLogger(__name__)


def mechanism_of(settings: FederatedConfig) -> Mechanism:
    """The user-level (A.1) mechanism these settings run: N, q, z, C, T, delta."""
    return Mechanism(
        population=settings.nodes(),
        sample_rate=settings.user_dp.fraction_fit,
        noise_multiplier=settings.user_dp.noise_multiplier,
        clip=settings.user_dp.clipping_norm,
        rounds=settings.rounds,
        delta=settings.delta,
    )


def a1_step(settings: FederatedConfig, rounds: int = 1) -> Step:
    """The A.1 ledger's step for ``rounds`` released rounds: z at the Poisson rate q."""
    return (settings.user_dp.noise_multiplier, settings.user_dp.fraction_fit, rounds)


def planned_a2(settings: FederatedConfig) -> Step:
    """The A.2 node's accounting step, a function of the settings only (never of the pool's size,
    which the published A.2 epsilon would otherwise reveal): Poisson batches at the public rate
    batch_size / max_examples as Opacus accounts it (``dp_sgd.accounted_rate``), local.steps.
    The A.2 node takes and reports exactly this step, tagged (``wire.a2_claim``); the server
    accepts no other, and no untagged claim."""
    rate = accounted_rate(public_sample_rate(settings.local.batch_size, settings.local.max_examples))
    return (settings.local_dp.noise_multiplier, rate, settings.local.steps)


def a2_claim_key(pool: Path | None) -> bytes | None:
    """The key the server checks the A.2 node's claimed step with (created beside the pool on
    first use); None without a pool: a server that knows no pool accounts no A.2 claim."""
    return None if pool is None else claim_key(pool, create=True)


def count_step(settings: FederatedConfig) -> Step:
    """The A.2 ledger's step for the noised release of the pool's counts (one Gaussian mechanism)."""
    return (settings.a2.count_noise_multiplier, 1.0, 1)


def reserve(settings: FederatedConfig, state: ServerState, pool: Path | None) -> list[Step]:
    """Budget kept back for the pool's noised counts, released when the rounds end."""
    return [count_step(settings)] if pool is not None and state.pool_counts is None else []


def require_budget(settings: FederatedConfig, ledger: Ledger, state: ServerState, pool: bool) -> None:
    """BudgetExceeded, naming the epsilon it would spend, when the configured rounds cannot all
    be released within ``epsilon_budget``: the user-level ledger after every remaining round, and
    the record-level one with one A.2 run per remaining round (and the pool counts' release)."""
    if settings.epsilon_budget is None:
        return
    remaining = max(0, settings.rounds - state.round)
    mechanism_of(settings).require(settings.epsilon_budget)  # names N, q, z of a hopeless config
    a1 = a1_step(settings, remaining) if remaining else None
    z, rate, steps = planned_a2(settings)
    a2 = [(z, rate, steps * remaining)] if remaining else []
    held = [count_step(settings)] if pool and state.pool_counts is None else []
    ledger.plan(a1, [*a2, *held], what=f"the {remaining} remaining rounds of this federation")


def plan_round(settings: FederatedConfig, ledger: Ledger, held: list[Step]) -> str | None:
    """Plan the next round's privacy spend (A.1 and one A.2 run, whether or not the pool will
    train: a plan that read the pool would make the stop depend on it; ``held``: the pool
    counts' step in reserve); the reason to stop when it would exceed the budget, else None."""
    try:
        ledger.plan(a1_step(settings), [planned_a2(settings), *held])
    except BudgetExceeded as exc:
        log.warning("%s", exc)
        return f"budget: {exc}"
    return None


def release_pool_counts(
    state: ServerState, ledger: Ledger, settings: FederatedConfig, pool: Path | None
) -> None:
    """Release the A.2 pool's counts once, noised and accounted (its step was kept in reserve by
    every round's budget check); not at all when there is no pool or the budget forbids it."""
    if state.pool_counts is not None or pool is None:
        return
    step = count_step(settings)
    try:
        ledger.plan(None, [step], what="releasing the A.2 pool's noised counts")
    except BudgetExceeded as exc:
        state.pool_counts = {"released": False, "reason": f"budget: {exc}"}
        return
    eligible = [c for c in DATA_CATEGORIES if c not in NEVER_SHARED]
    rng = np.random.default_rng()  # seeded from the OS's entropy
    counts = noised_counts(pool, settings.a2.k, eligible, settings.a2.count_noise_multiplier, rng)
    ledger.record_release("a2_pool_counts", step)
    state.pool_counts = {"released": True, **counts}
