"""Privacy accounting for federated rounds, with Opacus's RDP accountant.

Two mechanisms, two guarantees:
- A.1, user-level DP: each round the server adds Gaussian noise (multiplier ``z``) to the sum of
  clipped client updates, with clients sampled at rate ``q`` -> one accountant step per round;
- A.2, record-level central DP: DP-SGD on the anonymised pool, ``steps`` accountant steps per
  round at the batch sampling rate.

The ledger is a JSON file (the round records read it), so accounting survives a server restart.
:meth:`Ledger.plan` refuses a round that would push either epsilon over the budget.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opacus.accountants import RDPAccountant

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.errors import NimmerError

Step = tuple[float, float, int]  # (noise multiplier, sampling rate, steps)


class BudgetExceeded(NimmerError):
    """The next round would spend more privacy than the configured budget."""


def epsilon(history: list[Step], delta: float) -> float:
    """Epsilon at ``delta`` after ``history``, as Opacus's RDP accountant computes it."""
    merged: dict[tuple[float, float], int] = {}
    for noise, rate, steps in history:  # RDP adds up, so equal mechanisms can be merged
        merged[(noise, rate)] = merged.get((noise, rate), 0) + steps
    accountant = RDPAccountant()
    accountant.history = [(noise, rate, steps) for (noise, rate), steps in merged.items() if steps > 0]
    return float(accountant.get_epsilon(delta=delta)) if accountant.history else 0.0


@dataclass
class Ledger:
    delta: float
    budget: float | None = None
    a1: list[Step] = field(default_factory=list)
    a2: list[Step] = field(default_factory=list)
    rounds: list[dict] = field(default_factory=list)

    def spent(self) -> dict[str, float]:
        return {
            "a1_user_level": epsilon(self.a1, self.delta),
            "a2_record_level": epsilon(self.a2, self.delta),
        }

    def plan(self, a1: Step | None, a2: Step | None) -> dict[str, float]:
        """The epsilons after a round with these steps; BudgetExceeded if either would pass the budget."""
        after = {
            "a1_user_level": epsilon(self.a1 + ([a1] if a1 else []), self.delta),
            "a2_record_level": epsilon(self.a2 + ([a2] if a2 else []), self.delta),
        }
        if self.budget is not None:
            over = {k: v for k, v in after.items() if v > self.budget}
            if over:
                raise BudgetExceeded(
                    f"round {len(self.rounds) + 1} would spend epsilon "
                    + ", ".join(f"{k}={v:.3f}" for k, v in over.items())
                    + f" > budget {self.budget} at delta {self.delta}; the federation stops here"
                )
        return after

    def record(self, a1: Step | None, a2: Step | None) -> dict:
        """Account a completed round and return its record (per-round and cumulative epsilon)."""
        before = self.spent()
        after = self.plan(a1, a2)
        self.a1 += [a1] if a1 else []
        self.a2 += [a2] if a2 else []
        entry = {
            "round": len(self.rounds) + 1,
            "delta": self.delta,
            **{f"epsilon_{k}": v for k, v in after.items()},
            **{f"epsilon_{k}_this_round": after[k] - before[k] for k in after},
        }
        self.rounds.append(entry)
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
            delta, budget, [tuple(s) for s in data["a1"]], [tuple(s) for s in data["a2"]], data["rounds"]
        )
