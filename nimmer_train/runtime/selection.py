"""Which register speaks this turn: the player's gesture-alignment accumulator and hysteresis.

The accumulator is a decaying trait vector: each turn ``a <- decay * a + (1 - decay) * gesture``.
Registers are scored by cosine similarity between ``a`` and their trait profile. The current
register keeps the floor until one challenger beats it by more than ``margin`` on ``patience``
consecutive turns (the same challenger each time), so noise below the margin never switches and a
sustained change always does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from nimmer_train.voice.traits import TRAIT_AXES, check_vector


@dataclass(frozen=True)
class SelectionConfig:
    decay: float = 0.8  # weight of the past in the accumulator, per turn
    margin: float = 0.1  # a challenger must beat the current register's score by more than this
    patience: int = 3  # ... on this many consecutive turns

    def __post_init__(self) -> None:
        if not 0.0 <= self.decay < 1.0:
            raise ValueError(f"runtime.selection.decay={self.decay}: must be in [0, 1)")
        if self.margin < 0 or self.patience < 1:
            raise ValueError("runtime.selection: margin must be >= 0 and patience >= 1")


def vector(traits: dict[str, float]) -> list[float]:
    return [float(traits.get(axis, 0.0)) for axis in TRAIT_AXES]


def cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return 0.0 if na == 0 or nb == 0 else sum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)


@dataclass
class RegisterSelector:
    """One per (player, NPC): feed it each turn's gesture, read the register that speaks."""

    profiles: dict[str, dict[str, float]]  # register -> trait profile
    config: SelectionConfig = field(default_factory=SelectionConfig)
    current: str | None = None
    accumulator: list[float] = field(default_factory=lambda: [0.0] * len(TRAIT_AXES))
    _challenger: str | None = None
    _streak: int = 0
    switches: int = 0

    def scores(self) -> dict[str, float]:
        return {name: cosine(self.accumulator, vector(p)) for name, p in self.profiles.items()}

    def update(self, gesture: dict[str, float]) -> str:
        """Fold in one turn's gesture (a trait vector in [-1, 1]) and return the register to use."""
        check_vector(gesture, "gesture")
        d = self.config.decay
        target = vector(gesture)
        self.accumulator = [d * a + (1 - d) * g for a, g in zip(self.accumulator, target, strict=True)]
        scores = self.scores()
        best = max(scores, key=lambda name: (scores[name], name))
        if self.current is None:
            self.current = best
            return best
        if best != self.current and scores[best] - scores[self.current] > self.config.margin:
            self._streak = self._streak + 1 if best == self._challenger else 1
            self._challenger = best
            if self._streak >= self.config.patience:
                self.current, self._challenger, self._streak = best, None, 0
                self.switches += 1
        else:
            self._challenger, self._streak = None, 0
        return self.current
