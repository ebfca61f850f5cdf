"""The Hellenic trait axes: one home for their names, shared by every stage.

Values on an axis live in [-1, 1] and follow the design's +1/0/-1 grammar.
"""

from __future__ import annotations

TRAIT_AXES: tuple[str, ...] = ("Sophrosyne", "Dikaiosyne", "Philotes", "Aletheia", "Mnemosyne")


def check_axis(name: str) -> str:
    """Return ``name`` if it is a known trait axis, else raise ValueError naming the known ones."""
    if name not in TRAIT_AXES:
        raise ValueError(f"unknown trait axis {name!r}; known axes: {', '.join(TRAIT_AXES)}")
    return name
