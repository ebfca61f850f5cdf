"""Privacy accounting for federated rounds, with Opacus's RDP accountant.

Two ledgers, two guarantees:
- A.1, user-level DP: each released round the server adds Gaussian noise (multiplier ``z``) to
  the sum of clipped client contributions (update and A.1 indicator), with nodes sampled at rate
  ``q`` -> one accountant step per round;
- A.2, record-level central DP: every DP mechanism that touches the anonymised pool's records:
  each A.2 node's DP-SGD run in a released round (``steps`` accountant steps at its batch
  sampling rate; two A.2 nodes in a round are two entries), and the noised release of the pool's
  counts (one step at sampling rate 1).

A mechanism with noise multiplier 0 has no guarantee: its epsilon is None (never inf), and the
federation only runs one under ``federated.no_privacy``.

The ledger is a JSON file (the round records read it), so accounting survives a server restart.
:meth:`Ledger.plan` refuses steps that would push either epsilon over the budget; it is called
with the planned steps before a round and with the actual steps before the round's release.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.errors import NimmerError

Step = tuple[float, float, int]  # (noise multiplier, sampling rate, steps)


class BudgetExceeded(NimmerError):
    """The next round would spend more privacy than the configured budget."""


def epsilon(history: Sequence[Step], delta: float) -> float | None:
    """Epsilon at ``delta`` after ``history``, as Opacus's RDP accountant computes it (the same
    orders, sums and conversion, bit for bit); None when a step without noise makes it unbounded
    (no guarantee)."""
    merged: dict[tuple[float, float], int] = {}
    for noise, rate, steps in history:  # RDP adds up, so equal mechanisms can be merged
        if steps > 0 and noise <= 0:
            return None
        merged[(noise, rate)] = merged.get((noise, rate), 0) + steps
    mechanisms = [(noise, rate, steps) for (noise, rate), steps in merged.items() if steps > 0]
    if not mechanisms:
        return 0.0
    # RDPAccountant.get_privacy_spent: sum of compute_rdp(q, z, T, orders), which is T times one step's
    rdp = sum([_rdp_of_one_step(noise, rate) * steps for noise, rate, steps in mechanisms])
    value, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp, delta=delta)
    value = float(value)
    return value if math.isfinite(value) else None


@lru_cache(maxsize=4096)
def _rdp_of_one_step(noise: float, rate: float) -> np.ndarray:
    """Opacus's RDP of one sampled Gaussian step at each of its accountant's orders. Computing it
    takes about 0.3 s (the fractional orders' series); a federation asks for the same (z, q) with a
    growing step count every round, so it is computed once per process."""
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = rdp_analysis.compute_rdp(q=rate, noise_multiplier=noise, steps=1, orders=orders)
    rdp.setflags(write=False)  # shared by every caller
    return rdp


@dataclass
class Ledger:
    delta: float
    budget: float | None = None
    a1: list[Step] = field(default_factory=list)
    a2: list[Step] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)
    releases: list[dict] = field(default_factory=list)  # accounted releases outside the rounds

    def spent(self) -> dict[str, float | None]:
        return {
            "a1_user_level": epsilon(self.a1, self.delta),
            "a2_record_level": epsilon(self.a2, self.delta),
        }

    def after(self, a1: Step | None, a2: Sequence[Step] = ()) -> dict[str, float | None]:
        """The epsilons after these steps, without the budget check."""
        return {
            "a1_user_level": epsilon(self.a1 + ([a1] if a1 else []), self.delta),
            "a2_record_level": epsilon(self.a2 + list(a2), self.delta),
        }

    def plan(self, a1: Step | None, a2: Sequence[Step] = (), what: str | None = None) -> dict:
        """The epsilons after these steps; BudgetExceeded if either would pass the budget (an
        unbounded epsilon passes any budget). ``what`` names the spend in the message."""
        after = self.after(a1, a2)
        if self.budget is not None:
            over = {k: v for k, v in after.items() if v is None or v > self.budget}
            if over:
                figures = ", ".join(f"{k}={'inf' if v is None else f'{v:.3f}'}" for k, v in over.items())
                raise BudgetExceeded(
                    f"{what or f'round {len(self.rounds) + 1}'} would spend epsilon {figures} > budget "
                    f"{self.budget} at delta {self.delta}; the federation stops here"
                )
        return after

    def record(self, a1: Step | None, a2: Sequence[Step] = ()) -> dict:
        """Account a released round and return its entry (per-round and cumulative epsilon). The
        budget is checked before the release (:meth:`plan`), never here: a released round is
        always accounted."""
        before, after = self.spent(), self.after(a1, a2)
        self.a1 += [a1] if a1 else []
        self.a2 += list(a2)
        entry = {
            "round": len(self.rounds) + 1,
            "delta": self.delta,
            **{f"epsilon_{k}": v for k, v in after.items()},
            **{f"epsilon_{k}_this_round": _minus(after[k], before[k]) for k in after},
        }
        self.rounds.append(entry)
        return entry

    def record_release(self, what: str, a2: Step) -> dict:
        """Account a release outside the rounds (the noised A.2 pool counts) in the A.2 ledger."""
        self.a2.append(a2)
        entry = {"what": what, "step": list(a2), "epsilon_a2_record_level": self.spent()["a2_record_level"]}
        self.releases.append(entry)
        return entry

    def save(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))

    @classmethod
    def load(cls, path: Path, delta: float, budget: float | None) -> Ledger:
        if not path.exists():
            return cls(delta, budget)
        return cls.from_dict(json.loads(path.read_text()), delta, budget, str(path))

    @classmethod
    def from_dict(cls, data: dict, delta: float, budget: float | None, where: str = "the ledger") -> Ledger:
        if data["delta"] != delta:
            raise NimmerError(f"{where} accounts at delta {data['delta']}, not {delta}; keep delta fixed")
        return cls(
            delta,
            budget,
            [tuple(s) for s in data["a1"]],
            [tuple(s) for s in data["a2"]],
            data["rounds"],
            data.get("releases", []),
        )


def _minus(after: float | None, before: float | None) -> float | None:
    return None if after is None or before is None else after - before
