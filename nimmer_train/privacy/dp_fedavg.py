"""DP-FedAvg exactly as it is accounted (McMahan et al. 2018, with a fixed denominator).

Each round every contributor of a population of ``N`` is sampled independently with
probability ``q`` (Poisson sampling); each sampled contributor's update is clipped to L2 norm
``C``; the clipped updates are summed with equal weight, Gaussian noise of standard deviation
``z * C`` is added to the sum, and the sum is divided by the *expected* cohort ``q * N``, never
by the number of survivors. Dropouts then cost utility, never privacy: the sensitivity of the
released mean to one contributor is ``C / (q N)`` whoever answered, which is what Opacus's RDP
accountant assumes for one step at sample rate ``q``.

Every noise draw and every sampling mask comes from :func:`entropy_rng` (the OS's entropy), so
neither a configured seed nor NumPy's global Mersenne Twister can reproduce the noise. Tests and
the sweep simulator pass their own generator to reproduce a run, never the federation.

This module holds the arithmetic that the Flower round loop, the sweep simulator and the audits
share; the accounting itself lives in :mod:`nimmer_train.privacy.accounting`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nimmer_train.privacy.accounting import BudgetExceeded, Step, epsilon

ACCOUNTANT = "opacus.rdp"  # Opacus's RDP accountant, one step per round at sample rate q
SAMPLING = "poisson"  # each contributor independently with probability q, every round


@dataclass(frozen=True)
class Mechanism:
    """The user-level mechanism of one federation: who is sampled, how much noise, how often."""

    population: int  # N: contributors who could be sampled
    sample_rate: float  # q: each contributor's independent inclusion probability per round
    noise_multiplier: float  # z: noise std on the sum is z * C
    clip: float  # C: L2 bound of one contributor's update
    rounds: int  # T: released rounds (one accountant step each)
    delta: float

    @property
    def expected_cohort(self) -> float:
        """q * N: the fixed denominator of every released mean."""
        return self.sample_rate * self.population

    @property
    def noise_std(self) -> float:
        """Standard deviation of the noise on the released mean, per coordinate: z C / (q N)."""
        return self.noise_multiplier * self.clip / self.expected_cohort

    def step(self) -> Step:
        """One round as the accountant sees it."""
        return (self.noise_multiplier, self.sample_rate, 1)

    def epsilon(self, rounds: int | None = None) -> float | None:
        """User-level epsilon at ``delta`` after ``rounds`` (default: all T); None without noise."""
        return epsilon(
            [(self.noise_multiplier, self.sample_rate, self.rounds if rounds is None else rounds)], self.delta
        )

    def describe(self) -> dict[str, float | int | str | None]:
        """What a record, a manifest or a model card states about this mechanism."""
        return {
            "population": self.population,
            "sample_rate": self.sample_rate,
            "expected_cohort": self.expected_cohort,
            "noise_multiplier": self.noise_multiplier,
            "clipping_norm": self.clip,
            "rounds": self.rounds,
            "delta": self.delta,
            "noise_std": self.noise_std,
            "accountant": ACCOUNTANT,
            "sampling": SAMPLING,
        }

    def require(self, budget: float | None, spent_rounds: int = 0) -> float | None:
        """The epsilon of all T rounds; BudgetExceeded (naming it) when it passes ``budget``.
        Called before the first round: a federation that cannot finish within its budget never
        starts. ``spent_rounds`` rounds already accounted count too (a resumed run)."""
        total = self.epsilon(max(self.rounds, spent_rounds))
        if budget is not None and (total is None or total > budget):
            figure = "inf (no noise)" if total is None else f"{total:.3f}"
            raise BudgetExceeded(
                f"this federation would spend user-level epsilon {figure} over {self.rounds} rounds "
                f"(N={self.population}, q={self.sample_rate:g}, z={self.noise_multiplier:g}, "
                f"delta={self.delta:g}) > budget {budget}: raise the noise multiplier or the population, "
                "or lower the rounds or the sample rate (see docs/privacy.md)"
            )
        return total


def noise_multiplier_for(
    target: float, sample_rate: float, rounds: int, delta: float, precision: float = 1e-3
) -> float:
    """The smallest noise multiplier z whose T rounds at rate q spend at most ``target``
    (bisection on Opacus's RDP accountant; what the sweep and the presets use)."""

    def spent(z: float) -> float:
        value = epsilon([(z, sample_rate, rounds)], delta)
        return math.inf if value is None else value

    low, high = 0.0, 1.0
    while spent(high) > target:
        low, high = high, high * 2
        if high > 1e4:
            raise ValueError(f"no noise multiplier reaches epsilon {target} at q={sample_rate}, T={rounds}")
    while high - low > precision:
        mid = (low + high) / 2
        if spent(mid) > target:
            low = mid
        else:
            high = mid
    return high


def entropy_rng() -> np.random.Generator:
    """A NumPy generator seeded from 256 bits of the OS's entropy."""
    return np.random.default_rng(int.from_bytes(os.urandom(32), "little"))


def poisson_cohort(population: int, sample_rate: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of the contributors sampled this round: each independently with probability q.

    Drawn as a binomial count and then a uniform subset, which is the same distribution as N
    independent coin flips but costs O(cohort) instead of O(N) for large populations."""
    if not 0.0 < sample_rate <= 1.0:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
    size = int(rng.binomial(population, sample_rate))
    return np.sort(rng.choice(population, size=size, replace=False))


def clip_update(flat: np.ndarray, clip: float) -> np.ndarray:
    """``flat`` scaled down to L2 norm at most ``clip`` (float64); a non-finite update is zero."""
    flat = np.asarray(flat, np.float64)
    norm = float(np.linalg.norm(flat))
    if not math.isfinite(norm):
        return np.zeros_like(flat)
    return flat * min(1.0, clip / norm) if norm > 0 else flat


def release(clipped_sum: np.ndarray, mechanism: Mechanism, rng: np.random.Generator) -> np.ndarray:
    """The released mean of one round: (sum of clipped updates + N(0, (z C)^2)) / (q N)."""
    total = np.asarray(clipped_sum, np.float64)
    noise = rng.normal(0.0, mechanism.noise_multiplier * mechanism.clip, total.shape)
    return (total + noise) / mechanism.expected_cohort


def release_arrays(
    sums: Sequence[np.ndarray], mechanism: Mechanism, rng: np.random.Generator
) -> list[np.ndarray]:
    """:func:`release` of a list of summed tensors (one Gaussian vector over all of them, drawn in
    their order), returned in their shapes, float64."""
    flat = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in sums])
    released = release(flat, mechanism, rng)
    out, start = [], 0
    for a in sums:
        size = int(np.asarray(a).size)
        out.append(released[start : start + size].reshape(np.shape(a)))
        start += size
    return out


def aggregate(updates: Sequence[np.ndarray], mechanism: Mechanism, rng: np.random.Generator) -> np.ndarray:
    """Clip each flat update, sum with equal weight, release: one DP-FedAvg round's mean."""
    if not updates:
        raise ValueError("aggregate needs at least one update to know the shape")
    total = np.zeros_like(np.asarray(updates[0], np.float64))
    for update in updates:
        total += clip_update(update, mechanism.clip)
    return release(total, mechanism, rng)
