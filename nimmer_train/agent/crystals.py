"""The knowledge crystal: a memory entry with a lifecycle, an origin, provenance, governance and a
validity interval, and the one function that moves it between lifecycle states.

A crystal is an ``entries`` row (text, embedding, semantic type, valence, access count, class,
category: :mod:`nimmer_train.memory.entries`) plus its ``crystals`` row (schema v4). Every
entry has one: a trigger creates it with the entry, so writers that predate crystals still
produce them. Lifecycle::

    generated -> activated -> consolidated -> archived -> expired
    (generated -> consolidated / archived / expired, activated -> archived / expired, ...)
    frozen (skills): never decays; leaves only for expired, when its skill file is gone

:func:`transition` is the only writer of ``lifecycle``; each call writes one ``crystal_audit``
row. The validity interval (``valid_from`` / ``valid_to`` / ``superseded_by``) is orthogonal to
the lifecycle: a newer fact closes an older one without expiring or deleting it.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import apsw

from nimmer_train.errors import NimmerError

LIFECYCLES = ("generated", "activated", "consolidated", "archived", "expired", "frozen")
ORIGINS = ("file", "transcript", "skill", "note", "dream")
LIFESPANS = ("permanent", "ttl", "decay")
ACTIVE = ("generated", "activated", "consolidated")  # what consolidation rescores and merges
SEARCHABLE = ("generated", "activated", "consolidated", "frozen")
EDGES: dict[str, frozenset[str]] = {
    "generated": frozenset({"activated", "consolidated", "archived", "expired"}),
    "activated": frozenset({"consolidated", "archived", "expired"}),
    "consolidated": frozenset({"archived", "expired"}),
    "archived": frozenset({"expired"}),
    "frozen": frozenset({"expired"}),
    "expired": frozenset(),
}


class IllegalTransition(NimmerError):
    """A lifecycle move that EDGES does not allow; nothing was written."""


def content_hash(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class CrystalSpec:
    """What a writer says about a new crystal beyond the entry fields."""

    text: str
    origin: str
    semantic_type: str | None = None  # inferred from origin and text when None
    path: str | None = None
    start_line: int | None = None
    end_line: int | None = None
    session_id: str | None = None
    turn_ids: tuple[str, ...] = ()
    speaker: str = "agent"
    lifespan: str = "decay"
    ttl_s: float | None = None
    valid_from: float | None = None
    directive: bool = False
    importance: float = 0.5
    emotional_valence: float = 0.0
    memory_class: str = "working"
    source_hash: str | None = None  # what ingestion compares; the text's sha256 when None
    source_ids: tuple[str, ...] = ()  # event_uids it was made from (a dream insight's sources)
    embed_text: str | None = None  # what its vector is made of when not ``text`` (see exchange_specs)
    entry_fields: dict[str, object] = field(default_factory=dict)

    def check(self) -> None:
        if self.origin not in ORIGINS:
            raise NimmerError(f"origin: {self.origin!r} is not one of {', '.join(ORIGINS)}")
        if self.lifespan not in LIFESPANS:
            raise NimmerError(f"lifespan: {self.lifespan!r} is not one of {', '.join(LIFESPANS)}")
        if (self.lifespan == "ttl") != (self.ttl_s is not None):
            raise NimmerError("ttl_s: give it exactly when lifespan is 'ttl'")
        if self.ttl_s is not None and self.ttl_s <= 0:
            raise NimmerError(f"ttl_s: {self.ttl_s} must be positive")


@dataclass(frozen=True)
class Crystal:
    """One crystal as the tools report it (``id`` is the entry's event_uid)."""

    entry_id: int
    id: str
    text: str
    semantic_type: str
    lifecycle: str
    origin: str
    store: str
    path: str | None
    start_line: int | None
    end_line: int | None
    session_id: str | None
    turn_ids: tuple[str, ...]
    speaker: str
    importance: float
    access_count: int
    created_at: float
    valid_from: float
    valid_to: float | None
    merged_from: tuple[str, ...]  # event_uids of the crystals merged into this one
    memory_class: str
    data_category: str

    def public(self) -> dict[str, object]:
        out = {k: v for k, v in self.__dict__.items() if k != "entry_id"}
        out["turn_ids"], out["merged_from"] = list(self.turn_ids), list(self.merged_from)
        return out


CRYSTAL_SELECT = (
    "SELECT e.id, e.event_uid, e.text, e.semantic_type, c.lifecycle, c.origin, c.path, c.start_line, "
    "c.end_line, e.session_id, c.turn_ids, e.speaker, c.importance, e.access_count, e.created_at, "
    "c.valid_from, c.valid_to, c.merged_from, e.memory_class, e.data_category "
    "FROM entries e JOIN crystals c ON c.entry_id = e.id"
)


def crystal_from_row(row: tuple, store: str) -> Crystal:
    values = list(row)
    values[10] = tuple(json.loads(values[10]))
    values[17] = tuple(json.loads(values[17]))
    return Crystal(*values[:6], store, *values[6:])  # type: ignore[arg-type]


def load(db: apsw.Connection, entry_ids: Iterable[int], store: str) -> dict[int, Crystal]:
    ids = list(entry_ids)
    out: dict[int, Crystal] = {}
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        sql = f"{CRYSTAL_SELECT} WHERE e.id IN ({', '.join('?' * len(chunk))})"
        for row in db.execute(sql, chunk):
            out[row[0]] = crystal_from_row(row, store)
    return out


def audit(
    db: apsw.Connection, entry_id: int, now: float, before: str | None, after: str, reason: str
) -> None:
    uid = db.execute("SELECT event_uid FROM entries WHERE id = ?", (entry_id,)).fetchone()
    db.execute(
        "INSERT INTO crystal_audit (entry_id, event_uid, at, from_state, to_state, reason) "
        "VALUES (?, ?, ?, ?, ?, ?)",
        (entry_id, uid[0] if uid else "", now, before, after, reason),
    )


def transition(db: apsw.Connection, entry_id: int, to: str, reason: str, now: float) -> str:
    """Move one crystal to ``to`` if EDGES allows it, with one audit row; returns the old state.

    Call inside the caller's transaction (``with db:``) so the move and its audit row commit
    together with whatever caused them.
    """
    row = db.execute("SELECT lifecycle FROM crystals WHERE entry_id = ?", (entry_id,)).fetchone()
    if row is None:
        raise IllegalTransition(f"crystal {entry_id}: no such crystal")
    before = row[0]
    if to not in EDGES[before]:
        raise IllegalTransition(
            f"crystal {entry_id}: {before} -> {to} is not allowed (allowed from {before}: "
            f"{', '.join(sorted(EDGES[before])) or 'none'})"
        )
    db.execute("UPDATE crystals SET lifecycle = ?, lifecycle_at = ? WHERE entry_id = ?", (to, now, entry_id))
    audit(db, entry_id, now, before, to, reason)
    return before


def supersede(db: apsw.Connection, old_id: int, new_id: int, now: float) -> None:
    """Close ``old_id``'s validity interval at ``now`` in favour of ``new_id`` (nothing deleted).
    Cross-references hold event_uids: SQLite reuses an entry id after the newest row is purged."""
    db.execute(
        "UPDATE crystals SET valid_to = ?, superseded_by = (SELECT event_uid FROM entries WHERE id = ?) "
        "WHERE entry_id = ? AND valid_to IS NULL",
        (now, new_id, old_id),
    )


# Semantic type from origin first, then text patterns (ported from Bitterbot's inferSemanticType;
# the order decides ties: a preference that mentions a plan stays a preference).
_PATTERNS = (
    (
        "preference",
        re.compile(r"\b(prefers?|favou?rite|always use|i (really )?(like|love|hate)|rather)\b", re.I),
    ),
    ("goal", re.compile(r"\b(goal|objective|plan(s|ning)? to|intend|want to achieve|aim to)\b", re.I)),
    ("task_pattern", re.compile(r"\b(workflow|pipeline|step \d+|routine|procedure|checklist)\b", re.I)),
    (
        "relationship",
        re.compile(
            r"\b(friend|sister|brother|mother|father|wife|husband|partner|boss|colleague|neighbou?r)s?\b"
            r".{0,40}\b(is|are|was|works|lives|likes|knows|married)\b",
            re.I,
        ),
    ),
)


def infer_semantic_type(text: str, origin: str) -> str:
    if origin == "skill":
        return "skill"
    if origin == "dream":
        return "insight"
    for name, pattern in _PATTERNS:
        if pattern.search(text):
            return name
    if origin == "transcript":
        return "episode"
    if origin == "file":
        return "fact"
    return "general"
