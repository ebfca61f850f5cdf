"""Repeats last: a retrieval's hits reordered so that an older restatement of a hit already shown
comes after the hits that say something new.

Long conversations say the same things again: "I had grilled sardines for lunch, it was fine"
in nine sessions, each time with another reply. Ranked by relevance alone, those copies filled
the top ten of "can I safely order the shrimp and lobster platter?" and pushed the one line
that answers it ("I am badly allergic to shellfish") to 11th (bench_conversation_memory). A hit
is a repeat when a hit shown before it, from the same store and at least as new, has a cosine
with it of ``threshold`` or more. A repeat is ranked after every new hit: it comes back only
where fewer than ``n`` new hits exist, and the best copy always keeps its place.

"At least as new" is what keeps an update: MiniLM scores many different facts said in the same
words as near-copies ("I take 5 mg of ramipril" / "10 mg" 0.985, "the meeting is on Tuesday" /
"Thursday" 0.93, "I am allergic to peanuts" / "I am not" 0.96), so cosine alone cannot tell a
restatement from a changed value. A hit newer than every near-copy above it is never deferred:
the current value is shown wherever the stale one ranks. Only an older near-copy of something
shown is; a search that asks for history (``include_superseded``) skips the stage, and a copy in
another store (the in-between's clasp beside primary) never counts, since the prompt shows the
stores as separate layers. At 0.9 one statement with another reply is a repeat (0.94) and two
facts in the same sentence shape mostly are not ("Emil moved from Vienna to Turin" / "from Turin
to Oslo" 0.88, "I live in Oslo" / "I live in Bergen" 0.61).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence

import numpy as np

REPEAT_COSINE = 0.9  # a hit this close to an earlier, newer-or-equal one is a repeat; above 1: none is


def repeats_last(
    vectors: Sequence[np.ndarray | None],
    n: int,
    threshold: float = REPEAT_COSINE,
    times: Sequence[float] | None = None,
    stores: Sequence[Hashable] | None = None,
) -> list[int]:
    """The positions of the ``n`` hits to show, from ``vectors`` (unit rows, best hit first; None
    where a hit has no vector, which is never a repeat): the hits that are not repeats, in their
    order, then the repeats, in theirs. ``times``: when each hit's content became true (a hit is
    a repeat only of one at least as new; a NaN time never repeats); ``stores``: where each hit
    lives (a hit repeats only one of its own store). Without them every hit counts as equally
    new and from one store."""
    if threshold > 1.0 or n <= 0:
        return list(range(min(max(n, 0), len(vectors))))
    shown: list[int] = []
    repeats: list[int] = []
    seen: dict[Hashable, tuple[np.ndarray, np.ndarray, list[int]]] = {}  # store -> rows, times, count
    for i, vector in enumerate(vectors):
        if len(shown) == n:
            break
        at = -math.inf if times is None else float(times[i])
        store = None if stores is None else stores[i]
        if vector is not None and store in seen:
            rows, when, count = seen[store]
            k = count[0]
            if k and bool(np.any((rows[:k] @ vector >= threshold) & (when[:k] >= at))):
                repeats.append(i)
                continue
        shown.append(i)
        if vector is not None:
            if store not in seen:
                seen[store] = (np.empty((n, len(vector)), np.float32), np.empty(n), [0])
            rows, when, count = seen[store]
            rows[count[0]], when[count[0]] = vector, at
            count[0] += 1
    return (shown + repeats)[:n]
