"""Importance by an Ebbinghaus forgetting curve: a pure function of a crystal and ``now``.

    I = clamp(S_type * w * (1 - exp(-0.2 * (n + 1))) * exp(-lambda_eff * dt), 0, 1)
    lambda_eff = lambda * (1 - r * |valence|),  lambda = ln 2 / half_life

``dt`` is the time since the last access (or since creation), ``n`` the access count, ``w`` =
2 x the entry's stored importance (so the default 0.5 weighs 1 and a 0.7 note 1.4). With the
reference constants (half-life 16.04 days, r = 0.5, forget threshold 0.02) a default fact that
is never read is forgotten after 51 days; at |valence| = 1 after 102 days; read 5 times, 82 days.

Crystals that never decay: lifecycle ``frozen`` (skills), lifespan ``permanent``, and the
issue-5 memory classes ``cornerstone`` and ``birthright``. For them the time term is 1, so their
importance is constant in time. ``now`` is whatever clock the caller injects (game time works:
express ``half_life_s`` in game seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

TYPE_STRENGTH = {
    "preference": 1.2,
    "goal": 1.2,
    "task_pattern": 1.1,
    "insight": 1.1,
    "relationship": 1.1,
    "skill": 1.0,
    "fact": 1.0,
    "episode": 0.8,
    "general": 0.8,
}
NEVER_DECAY_CLASSES = ("cornerstone", "birthright")


@dataclass(frozen=True)
class ImportancePolicy:
    half_life_s: float = math.log(2) / 5e-7  # 16.04 days (Bitterbot's 5e-10 per ms)
    valence_resistance: float = 0.5
    access_rate: float = 0.2
    forget_threshold: float = 0.02


def never_decays(lifecycle: str, lifespan: str, memory_class: str) -> bool:
    return lifecycle == "frozen" or lifespan == "permanent" or memory_class in NEVER_DECAY_CLASSES


def importance(
    semantic_type: str,
    access_count: int,
    since_s: float,
    valence: float,
    base: float = 0.5,
    decays: bool = True,
    policy: ImportancePolicy = ImportancePolicy(),
) -> float:
    """The Ebbinghaus importance of one crystal ``since_s`` seconds after its last access."""
    strength = TYPE_STRENGTH.get(semantic_type, 0.8) * 2 * base
    value = strength * (1 - math.exp(-policy.access_rate * (access_count + 1)))
    if decays:
        rate = math.log(2) / policy.half_life_s * (1 - policy.valence_resistance * abs(valence))
        value *= math.exp(-rate * max(0.0, since_s))
    return min(1.0, max(0.0, value))


def importance_many(
    types: np.ndarray,
    access_counts: np.ndarray,
    since_s: np.ndarray,
    valences: np.ndarray,
    bases: np.ndarray,
    decays: np.ndarray,
    policy: ImportancePolicy = ImportancePolicy(),
) -> np.ndarray:
    """:func:`importance` over arrays (consolidation rescoring); same values, element for element."""
    strength = np.array([TYPE_STRENGTH.get(t, 0.8) for t in types], dtype=np.float64) * 2 * bases
    value = strength * (1 - np.exp(-policy.access_rate * (access_counts + 1)))
    rate = math.log(2) / policy.half_life_s * (1 - policy.valence_resistance * np.abs(valences))
    value = np.where(decays, value * np.exp(-rate * np.maximum(0.0, since_s)), value)
    return np.clip(value, 0.0, 1.0)
