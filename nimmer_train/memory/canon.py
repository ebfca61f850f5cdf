"""The knowledge stack: world and district canon with paced propagation, and per-turn assembly
of the four layers (world, district, primary, and clasp only in the in-between, and only for a
prompt that stays on the device).

Canon rows carry priority (urgent / normal / background), scope (world / district / local),
rate (ticks per district hop; 0 = instant) and ttl (ticks a district keeps a row after it
arrives; null = forever). :func:`propagate` is a pure function of the canon, the district graph
and the tick: a world row reaches a district ``hops * rate`` ticks after it was made, so
distant districts learn late; district and local rows stay in their own district.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from nimmer_train.errors import NimmerError
from nimmer_train.memory.player_memory import Mode, PlayerMemory, Retrieved
from nimmer_train.voice.prompt_dsl import MemoryScope

PRIORITY_ORDER = {"urgent": 0, "normal": 1, "background": 2}


@dataclass(frozen=True)
class Canon:
    uid: str
    text: str
    scope: str
    origin_district: str
    priority: str = "normal"
    rate_ticks_per_hop: int = 1
    ttl_ticks: int | None = None
    created_tick: int = 0


def set_districts(memory: PlayerMemory, edges: list[tuple[str, str]]) -> None:
    with memory.primary:
        memory.primary.execute("DELETE FROM district_edges")
        memory.primary.executemany(
            "INSERT OR IGNORE INTO district_edges VALUES (?, ?)",
            [(a, b) for a, b in edges] + [(b, a) for a, b in edges],
        )


def add_canon(memory: PlayerMemory, rows: list[Canon]) -> None:
    with memory.primary:
        memory.primary.executemany(
            "INSERT OR REPLACE INTO canon VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            [tuple(r.__dict__.values()) for r in rows],
        )


def hops_from(memory: PlayerMemory, origin: str) -> dict[str, int]:
    """Hop distance from ``origin`` to every reachable district (breadth-first)."""
    graph: dict[str, list[str]] = {}
    for a, b in memory.primary.execute("SELECT a, b FROM district_edges ORDER BY a, b"):
        graph.setdefault(a, []).append(b)
    hops, queue = {origin: 0}, deque([origin])
    while queue:
        here = queue.popleft()
        for there in graph.get(here, []):
            if there not in hops:
                hops[there] = hops[here] + 1
                queue.append(there)
    return hops


def propagate(memory: PlayerMemory, tick: int) -> None:
    """Bring canon_known up to ``tick``: arrivals by hop distance and rate, expiries by ttl."""
    rows = [Canon(*r) for r in memory.primary.execute("SELECT * FROM canon ORDER BY uid")]
    known = []
    for row in rows:
        reach = hops_from(memory, row.origin_district) if row.scope == "world" else {row.origin_district: 0}
        for district, hops in reach.items():
            arrives = row.created_tick + hops * row.rate_ticks_per_hop
            expired = row.ttl_ticks is not None and tick >= arrives + row.ttl_ticks
            if arrives <= tick and not expired:
                known.append((row.uid, district, arrives))
    with memory.primary:
        memory.primary.execute("DELETE FROM canon_known")
        memory.primary.executemany("INSERT INTO canon_known VALUES (?, ?, ?)", known)


def _canon_layer(memory: PlayerMemory, district: str, scopes: tuple[str, ...]) -> list[str]:
    rows = memory.primary.execute(
        f"SELECT c.text, c.priority, c.created_tick, c.uid FROM canon c JOIN canon_known k ON k.uid = c.uid "
        f"WHERE k.district = ? AND c.scope IN ({', '.join('?' * len(scopes))})",
        (district, *scopes),
    ).fetchall()
    rows.sort(key=lambda r: (PRIORITY_ORDER[r[1]], -r[2], r[3]))
    return [r[0] for r in rows]


def _within(lines: list[str], budget: int, count: Callable[[str], int]) -> list[str]:
    out, used = [], 0
    for line in lines:
        cost = count(line)
        if used + cost > budget:
            continue  # a shorter line further down may still fit
        out.append(line)
        used += cost
    return out


def word_tokens(text: str) -> int:
    """A tokenizer-free token estimate (words); pass a real tokenizer's count for exact budgets."""
    return len(text.split())


def assemble(
    memory: PlayerMemory,
    district: str,
    query: str | np.ndarray,
    mode: Mode,
    budgets: dict[str, int],
    count: Callable[[str], int] = word_tokens,
    k: int = 8,
    local: bool = False,
    exclude: frozenset[str] = frozenset(),  # event_uids left out (the lines already in the prompt)
    item: Callable[[Retrieved], str] = lambda hit: hit.entry.text,  # how a memory shows (dated: turn.py)
    min_relevance: float = -1.0,  # memories less similar to the query than this are left out
) -> MemoryScope:
    """The turn's knowledge stack as the prompt DSL's memory_scope, each layer within its budget.

    Layers: world canon known in ``district``, that district's own canon, the player's primary
    memories for ``query``, and in IN_BETWEEN mode the clasp memories too, but only when the
    prompt stays on the device (``local``: an in-process ring, Ring A). For any other ring the
    clasp store is not even read: the clasp has no transport path. Memories whose relevance
    (cosine similarity to the query) is below ``min_relevance`` stay out however recent or
    important: a small model echoes whatever the stack holds, so an unrelated memory is noise in
    its reply, not context. Deterministic for a given store, tick and query.
    """
    unknown = set(budgets) - {"world", "district", "primary", "clasp"}
    if unknown:
        raise NimmerError(f"unknown knowledge-stack layers {sorted(unknown)}")
    layers = {
        "world": _canon_layer(memory, district, ("world",)),
        "district": _canon_layer(memory, district, ("district", "local")),
    }
    with_clasp = mode is Mode.IN_BETWEEN and local
    hits = memory.retrieve(
        query, k=k, mode=mode if with_clasp else Mode.REALWORLD, exclude=exclude, min_relevance=min_relevance
    )
    layers["primary"] = [item(h) for h in hits if h.store == "primary"]
    if with_clasp:
        layers["clasp"] = [item(h) for h in hits if h.store == "clasp"]
    names = tuple(name for name in ("world", "district", "primary", "clasp") if name in layers)
    items = tuple(line for name in names for line in _within(layers[name], budgets.get(name, 0), count))
    return MemoryScope(layers=names, items=items)
