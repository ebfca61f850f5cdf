"""Repeats last: a retrieval's hits reordered so that a restatement of a better hit comes after
the hits that say something new.

Long conversations say the same things again: "I had grilled sardines for lunch, it was fine"
in six sessions, each time with another reply. Ranked by relevance alone, those copies filled
the top ten of "can I safely order the shrimp and lobster platter?" and pushed the one line
that answers it ("I am badly allergic to shellfish") to 11th (bench_conversation_memory,
held-out seeds). A hit whose cosine with a hit already taken reaches ``threshold`` is a repeat:
it is deferred, not dropped, so with nothing new to show the copies still come back, and the
best copy (by relevance, then recency) always keeps its place.

At 0.9 all-MiniLM-L6-v2 takes one statement with another reply as a repeat (cosine 0.94), but
not two facts said in the same words ("Emil moved from Vienna to Turin" / "from Turin to
Oslo": 0.88; "I live in Oslo" / "I live in Bergen": 0.61), so an update and the fact it
replaces are both shown. This is maximal marginal relevance reduced to its one decisive case:
a graded novelty penalty would also reorder distinct facts by how alike they sound.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

REPEAT_COSINE = 0.9  # a hit this close to a better one is a repeat; above 1: none is


def repeats_last(vectors: Sequence[np.ndarray | None], n: int, threshold: float = REPEAT_COSINE) -> list[int]:
    """The positions of the ``n`` hits to show, from ``vectors`` (unit rows, best hit first; None
    where a hit has no vector, which never counts as a repeat): the hits that repeat no better
    one, in their order, then the repeats, in theirs."""
    if threshold > 1.0:
        return list(range(min(n, len(vectors))))
    shown: list[int] = []
    repeats: list[int] = []
    seen: list[np.ndarray] = []
    for i, vector in enumerate(vectors):
        if len(shown) == n:
            break
        if vector is not None and seen and float(np.max(np.stack(seen) @ vector)) >= threshold:
            repeats.append(i)
            continue
        shown.append(i)
        if vector is not None:
            seen.append(vector)
    return (shown + repeats)[:n]
