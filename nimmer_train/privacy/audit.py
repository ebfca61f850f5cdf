"""An empirical lower bound beside the theoretical user-level epsilon of DP-FedAvg (A.1).

One-run audit (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run") with
canary contributors whose update is a random direction (Andrew et al., ICLR 2024, "One-shot
empirical privacy estimation for federated learning"):

1. ``m`` canary contributors each get a random unit direction ``c_i`` and are put into the
   population independently with probability 1/2 (the secret bits the auditor must guess);
2. the mechanism runs exactly as :mod:`nimmer_train.privacy.dp_fedavg` releases it, for all ``T``
   rounds: Poisson sampling at ``q`` of the ordinary contributors and of the included canaries, an
   included canary's update is ``C c_i``, :func:`~nimmer_train.privacy.dp_fedavg.aggregate` clips,
   sums, noises and divides by ``q N``;
3. the auditor sees every released round (what DP-FedAvg's accounting covers) and scores each
   canary by the alignment of the releases with its direction: per round the projection
   ``y_t = <release_t, c_i>``, standardised by the release's own scale, combined over rounds as
   the log-likelihood ratio of "present with probability q in each round" against "absent";
4. it guesses "included" for the ``k`` highest scores (abstaining on the rest) and counts the
   correct guesses; the bound is the largest epsilon that the paper's p-value (binomial tail at
   ``e^eps / (1 + e^eps)`` plus its delta term) rejects at 95 % confidence.

``k`` is not chosen after looking: a few counts fixed in advance (:data:`GUESS_FRACTIONS` of the
canaries that would take part in some round if all were included, ``m (1 - (1 - q)^T)``, a
figure of the public mechanism) are each tested at ``(1 - confidence) / len(counts)`` (a union
bound), and the best valid bound is reported. Ordinary contributors are synthetic: updates of
norm about ``C`` sharing one direction (what local training from a common model gives); the
bound holds whatever they are.

A lower bound above the theoretical epsilon means the mechanism leaks more than accounted: a bug.
With ``z = 0`` the audit must still find a bound of at least 3 (it has power). At a small ``q T``
few canaries ever take part (the demo's q = 0.004, T = 3: 1.2 %), so a fixed ``m`` proves nothing
whatever the noise: :func:`canaries_for_power` sizes ``m`` from the mechanism, and a published
audit carries its own z = 0 control (``control=True``), so a bound of 0 beside an epsilon says
whether the audit could have seen a leak at all, and :func:`canaries_to_decide` says what ``m``
would let even a perfect attack prove more than the accounted epsilon.

``release_round`` is the aggregator audited: :func:`dp_fedavg.aggregate` by default (the
arithmetic), and where the federation publishes, its own strategy's aggregation
(``federation.strategy_audit``), so that a defect in how the server sums, checks or noises a round
moves the bound (issue 43: an audit of the arithmetic alone could not see a client scaling a round).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.stats import binom

from nimmer_train.privacy.dp_fedavg import Mechanism, aggregate, entropy_rng, poisson_cohort, release

GUESS_FRACTIONS = (0.02, 0.05, 0.1, 0.2)  # guesses, as shares of the canaries that could take part
CONTROL_POWER = 3.0  # the z = 0 control's bound that makes an audit conclusive (issue 14)
POWER_PRESENT = 400  # canaries expected to take part in some round, when sizing m for power
MAX_CANARIES = 60_000
ORDINARY_SHARED = 0.6  # ordinary updates: this share of C along one common direction, the rest private
CHUNK = 256  # canary directions generated at a time when scoring
DECIDE_LIMIT = 1000 * 2**12  # the largest canary count canaries_to_decide tries (its cost: O(guesses))
# one round's release from its cohort's (unclipped) flat updates; None: the round released nothing
ReleaseRound = Callable[[list[np.ndarray], Mechanism, np.random.Generator], "np.ndarray | None"]


@dataclass(frozen=True)
class UserLevelAudit:
    """One audit run: the empirical bound beside the theory, and what it was computed from."""

    lower_bound: float  # empirical epsilon lower bound at ``confidence``
    theoretical_epsilon: float | None  # the mechanism's accounted epsilon at its delta (None: no noise)
    canaries: int  # m
    guesses: int  # r: canaries guessed "included" (the rest abstained)
    correct: int  # v
    confidence: float
    dim: int
    mechanism: Mechanism
    ceiling: float = 0.0  # the largest bound this audit could report (every guess right)
    control_lower_bound: float | None = None  # the same audit with z = 0 (None: not run)
    canaries_to_decide: int | None = None  # m whose ceiling passes the accounted epsilon (None: none)
    # (computed by the caller that publishes the audit, canaries_to_decide: it costs O(guesses))
    aggregator: str = "privacy.dp_fedavg.aggregate"  # what released the audited rounds

    @property
    def conclusive(self) -> bool | None:
        """Whether the z = 0 control reached :data:`CONTROL_POWER` (None: no control was run)."""
        return None if self.control_lower_bound is None else self.control_lower_bound >= CONTROL_POWER

    def record(self) -> dict[str, object]:
        """Flat figures for a privacy report or a benchmark."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "mechanism"}
        return {
            **fields,
            **dataclasses.asdict(self.mechanism),
            "expected_cohort": self.mechanism.expected_cohort,
            "conclusive": self.conclusive,
            "method": "one-run audit (Steinke et al. 2023), random-direction canary contributors",
        }


def one_run_p_value(canaries: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """The probability that an (eps, delta)-DP mechanism lets ``correct`` or more of ``guesses``
    guesses on ``canaries`` canaries be right, as Steinke et al. 2023 compute it for delta > 0:
    ``P[Bin(r, p) >= v] + 2 m delta max_i P[v - i <= Bin(r, p) < v] / i``, ``p = e^eps / (1 + e^eps)``."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct ({correct}) <= guesses ({guesses}) <= canaries ({canaries})")
    p = 1.0 / (1.0 + math.exp(-eps))
    beta = float(binom.sf(correct - 1, guesses, p))
    if delta == 0 or correct == 0:
        return min(beta, 1.0)
    i = np.arange(1, correct + 1)
    window = binom.sf(correct - i - 1, guesses, p) - beta  # P[v - i <= Bin < v]
    alpha = float(np.max(window / i))
    return min(beta + alpha * delta * 2 * canaries, 1.0)


def one_run_lower_bound(
    canaries: int, guesses: int, correct: int, delta: float, significance: float = 0.05
) -> float:
    """The largest epsilon whose p-value stays below ``significance`` (0 if none): the paper's
    search, the upper end grown until it fails, then bisection."""
    if one_run_p_value(canaries, guesses, correct, 0.0, delta) >= significance:
        return 0.0
    low, high = 0.0, 1.0
    while one_run_p_value(canaries, guesses, correct, high, delta) < significance:
        low, high = high, high * 2
    for _ in range(50):
        mid = (low + high) / 2
        if one_run_p_value(canaries, guesses, correct, mid, delta) < significance:
            low = mid
        else:
            high = mid
    return low


def canary_directions(keys: np.ndarray, dim: int) -> np.ndarray:
    """Unit random directions, one per key (two 63-bit integers; a canary's direction is its key's, so it is
    regenerated rather than stored: m x dim floats need not fit in memory)."""
    out = np.empty((len(keys), dim))
    for row, key in enumerate(keys):
        v = np.random.default_rng(key.tolist()).standard_normal(dim)
        out[row] = v / np.linalg.norm(v)
    return out


def canary_scores(releases: np.ndarray, keys: np.ndarray, mechanism: Mechanism, dim: int) -> np.ndarray:
    """Each canary's log-likelihood ratio "in the population" vs "not": per released round the
    projection of the noisy sum on the canary's direction (the direction all rounds share projected
    out), standardised by the sum's RMS per coordinate s (noise and every other contribution), is
    N(C / s, 1) with probability q and N(0, 1) otherwise for a canary in the population, N(0, 1)
    for one outside; rounds that released exactly nothing carry no information and are skipped."""
    sums = releases * mechanism.expected_cohort  # back to sum units, where a canary adds C c_i
    common = sums.sum(axis=0)
    if np.any(common):  # what every round shares (the contributors' common direction) is no canary
        common /= np.linalg.norm(common)
        sums = sums - np.outer(sums @ common, common)
    scale = np.linalg.norm(sums, axis=1) / math.sqrt(dim)
    live = scale > 0
    sums, scale = sums[live], scale[live]
    mu = mechanism.clip / scale  # a present canary's standardised shift, per round
    log_q = math.log(mechanism.sample_rate)
    log_not = math.log1p(-mechanism.sample_rate) if mechanism.sample_rate < 1 else -math.inf
    scores = np.empty(len(keys))
    for start in range(0, len(keys), CHUNK):
        y = (sums @ canary_directions(keys[start : start + CHUNK], dim).T) / scale[:, None]
        llr = np.logaddexp(log_not, log_q + mu[:, None] * y - mu[:, None] ** 2 / 2)
        scores[start : start + CHUNK] = llr.sum(axis=0)
    return scores


def run_with_canaries(
    mechanism: Mechanism,
    keys: np.ndarray,
    included: np.ndarray,
    dim: int,
    rng: np.random.Generator,
    release_round: ReleaseRound | None = None,
) -> np.ndarray:
    """The T released means (T x dim) of DP-FedAvg over ``mechanism.population`` synthetic ordinary
    contributors plus the included canaries, each Poisson-sampled at q every round, each round
    released by ``release_round`` (default :func:`aggregate`; a round it releases nothing for, or
    whose cohort is empty under it, is a row of zeros, which the scores skip)."""
    shared = rng.standard_normal(dim)
    shared *= ORDINARY_SHARED * mechanism.clip / np.linalg.norm(shared)
    private = math.sqrt(1 - ORDINARY_SHARED**2) * mechanism.clip / math.sqrt(dim)
    members = np.flatnonzero(included)
    releases = np.empty((mechanism.rounds, dim))
    for t in range(mechanism.rounds):
        ordinary = poisson_cohort(mechanism.population, mechanism.sample_rate, rng)
        canaries = (
            members[poisson_cohort(len(members), mechanism.sample_rate, rng)] if len(members) else members
        )
        updates = [shared + private * rng.standard_normal(dim) for _ in ordinary]
        updates += list(mechanism.clip * canary_directions(keys[canaries], dim))
        if release_round is not None:
            released = release_round(updates, mechanism, rng) if updates else None
            releases[t] = 0.0 if released is None else released
        elif updates:
            releases[t] = aggregate(updates, mechanism, rng)
        else:  # nobody sampled: the noise alone is released
            releases[t] = release(np.zeros(dim), mechanism, rng)
    return releases


def taking_part(mechanism: Mechanism) -> float:
    """The chance that a canary is sampled in at least one of the T rounds: 1 - (1 - q)^T."""
    return (
        -math.expm1(mechanism.rounds * math.log1p(-mechanism.sample_rate))
        if mechanism.sample_rate < 1
        else 1.0
    )


def guess_counts(
    canaries: int, mechanism: Mechanism | None = None, fractions: Sequence[float] = GUESS_FRACTIONS
) -> list[int]:
    """The numbers of "included" guesses tried, fixed before the run: ``fractions`` of the
    canaries that would take part in some round if all were included (of all ``canaries``
    without a mechanism). A canary never sampled leaves no trace, so guesses sized to ``m``
    at a small ``q T`` are mostly coin flips."""
    base = canaries * (taking_part(mechanism) if mechanism is not None else 1.0)
    return sorted({max(1, round(f * base)) for f in fractions})


def canaries_for_power(mechanism: Mechanism, present: int = POWER_PRESENT, cap: int = MAX_CANARIES) -> int:
    """Canaries enough that about ``present`` of them (included with probability 1/2) take part in
    some round, at least 1000 and at most ``cap``."""
    return int(min(cap, max(1000, math.ceil(present / (0.5 * taking_part(mechanism))))))


def best_provable_bound(canaries: int, mechanism: Mechanism, confidence: float) -> float:
    """The bound of ``canaries`` canaries when every guess of the largest count is right."""
    counts = guess_counts(canaries, mechanism)
    significance = (1 - confidence) / len(counts)
    return one_run_lower_bound(canaries, counts[-1], counts[-1], mechanism.delta, significance)


def canaries_to_decide(
    mechanism: Mechanism, epsilon: float | None = None, confidence: float = 0.95, limit: int = DECIDE_LIMIT
) -> int | None:
    """The fewest canaries (1000 times a power of 2) whose ceiling passes ``epsilon`` (default the
    accounted one): below it even a perfect attack cannot prove a leak beyond the published figure,
    so an audit of that size decides nothing. None when no count up to ``limit`` does (the delta
    term grows with m) or there is no epsilon."""
    target = mechanism.epsilon() if epsilon is None else epsilon
    if target is None:
        return None
    m = 1000
    while m <= limit:
        if best_provable_bound(m, mechanism, confidence) > target:
            return m
        m *= 2
    return None


def audit_user_level(
    mechanism: Mechanism,
    canaries: int = 1000,
    dim: int = 10_000,
    rng: np.random.Generator | None = None,
    confidence: float = 0.95,
    control: bool = False,
    release_round: ReleaseRound | None = None,
    aggregator: str = "privacy.dp_fedavg.aggregate",
) -> UserLevelAudit:
    """Run ``mechanism`` once with ``canaries`` random-direction canary contributors (each included
    with probability 1/2) and return the empirical epsilon lower bound at ``confidence`` beside
    the accounted epsilon. ``rng`` drives everything (membership, sampling, ordinary updates,
    noise); by default one generator from the OS's entropy, a seeded one reproduces a run.
    ``control``: also run the same audit with z = 0 (its bound says whether this one had power).
    ``release_round``: the aggregator audited (named ``aggregator``), :func:`aggregate` by default."""
    if canaries < 1 or dim < 1:
        raise ValueError(f"the audit needs canaries >= 1 and dim >= 1, got {canaries} and {dim}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    rng = rng if rng is not None else entropy_rng()
    keys = rng.integers(0, 2**63, size=(canaries, 2), dtype=np.int64)
    included = rng.random(canaries) < 0.5
    releases = run_with_canaries(mechanism, keys, included, dim, rng, release_round)
    ranked = np.argsort(-canary_scores(releases, keys, mechanism, dim), kind="stable")
    counts = guess_counts(canaries, mechanism)
    significance = (1 - confidence) / len(counts)
    best = (0.0, counts[0], int(included[ranked[: counts[0]]].sum()))
    for k in counts:
        correct = int(included[ranked[:k]].sum())
        bound = one_run_lower_bound(canaries, k, correct, mechanism.delta, significance)
        if bound > best[0]:
            best = (bound, k, correct)
    without_noise = dataclasses.replace(mechanism, noise_multiplier=0.0)
    control_bound = None
    if control:
        control_bound = audit_user_level(
            without_noise, canaries, dim, rng, confidence, release_round=release_round
        ).lower_bound
    return UserLevelAudit(
        lower_bound=best[0],
        theoretical_epsilon=mechanism.epsilon(),
        canaries=canaries,
        guesses=best[1],
        correct=best[2],
        confidence=confidence,
        dim=dim,
        mechanism=mechanism,
        ceiling=best_provable_bound(canaries, mechanism, confidence),
        control_lower_bound=control_bound,
        aggregator=aggregator,
    )
