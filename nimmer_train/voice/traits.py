"""The Hellenic trait axes: one home for their names and descriptors, shared by every stage.

Values on an axis live in [-1, 1] and follow the design's +1/0/-1 grammar: the sign says which
pole a trait leans to, the magnitude how strongly.
"""

from __future__ import annotations

TRAIT_AXES: tuple[str, ...] = ("Sophrosyne", "Dikaiosyne", "Philotes", "Aletheia", "Mnemosyne")

# (negative pole, positive pole): what a value near -1 or +1 sounds like in speech.
POLES: dict[str, tuple[str, str]] = {
    "Sophrosyne": ("unrestrained, impulsive, excessive", "composed, controlled, measured"),
    "Dikaiosyne": ("lawless, self-serving, scornful of order", "grave bearing, judicial weight"),
    "Philotes": ("cold, distant, transactional", "warm, attached to the interlocutor"),
    "Aletheia": ("concealing, evasive, dissembling", "candid, truth-telling, unveiled"),
    "Mnemosyne": ("forgetful, present-bound", "steeped in memory, recalling, elegiac"),
}


def check_axis(name: str) -> str:
    """Return ``name`` if it is a known trait axis, else raise ValueError naming the known ones."""
    if name not in TRAIT_AXES:
        raise ValueError(f"unknown trait axis {name!r}; known axes: {', '.join(TRAIT_AXES)}")
    return name


def check_vector(vector: dict[str, float], where: str = "trait vector") -> dict[str, float]:
    """Validate a trait vector: known axes, values in [-1, 1]. Returns it unchanged."""
    for axis, value in vector.items():
        if axis not in TRAIT_AXES:
            raise ValueError(f"{where}: unknown trait axis {axis!r}; known axes: {', '.join(TRAIT_AXES)}")
        if not -1.0 <= float(value) <= 1.0:
            raise ValueError(f"{where}: {axis}={value} is outside [-1, 1]")
    return vector


def describe(axis: str, value: float) -> str:
    """Words for ``value`` on ``axis``: the pole it leans to, qualified by strength."""
    negative, positive = POLES[axis]
    if abs(value) < 0.15:
        return f"balanced between {negative.split(',')[0]} and {positive.split(',')[0]}"
    strength = "strongly " if abs(value) >= 0.6 else "mildly " if abs(value) < 0.35 else ""
    return f"{strength}{positive if value > 0 else negative}"
