"""One player's memory on the device: writes embedded at write time, mode-aware retrieval.

A player folder holds primary.sqlite (working memory, vector-indexed with sqlite-vec) and, for
the in-between mode only, the sealed clasp store (through :mod:`nimmer_train.memory.clasp`). In
REALWORLD mode retrieval reads primary only and writes go to primary; in IN_BETWEEN mode
retrieval reads primary and clasp, and new writes go to clasp.

Retrieval score (Park et al. 2023, "Generative Agents", section 4.1: recency, importance and
relevance, equally weighted by default)::

    score = w_rel * relevance + w_imp * importance + w_rec * recency
    relevance = max(0, cosine similarity of query and entry)
    recency   = 0.995 ** hours since the entry was last accessed (or written)
    importance in [0, 1] as stored

Candidates are the ``candidate_factor * k`` nearest entries by cosine distance that pass the
class and category filters (an exact scan over the store's vec0 vectors held in memory, see
vector_index.py); they are re-ranked by the score and the top k are returned and their access
count and last access updated.
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path

import apsw
import numpy as np

from nimmer_train.errors import NimmerError
from nimmer_train.memory.clasp import clasp_exists, open_clasp
from nimmer_train.memory.db import connect, migrate
from nimmer_train.memory.embedding import Embedder
from nimmer_train.memory.entries import (
    COLUMNS,
    EMBEDDING_DIM,
    InvalidEntry,
    MemoryEntry,
    clean_text,
    validate,
)
from nimmer_train.memory.schema import PRIMARY_MIGRATIONS
from nimmer_train.memory.vector_index import VectorIndex

PRIMARY_FILE = "primary.sqlite"
log = logging.getLogger(__name__)
Clock = Callable[[], float]


class Mode(enum.Enum):
    REALWORLD = "realworld"
    IN_BETWEEN = "in_between"


def as_mode(mode: Mode | str) -> Mode:
    """``mode`` as a :class:`Mode`: the enum or its value ("realworld", "in_between") mean the
    same; anything else is refused (a string compared with ``is`` would read as REALWORLD and
    put in-between words in primary)."""
    try:
        return Mode(mode)
    except ValueError:
        known = ", ".join(repr(m.value) for m in Mode)
        raise NimmerError(f"mode: {mode!r} is not one of {known} (or a Mode)") from None


@dataclass(frozen=True)
class Weights:
    relevance: float = 1.0
    importance: float = 1.0
    recency: float = 1.0
    recency_decay_per_hour: float = 0.995
    candidate_factor: int = 5


@dataclass(frozen=True)
class Retrieved:
    entry: MemoryEntry
    store: str  # "primary" or "clasp"
    score: float
    relevance: float
    recency: float


class PlayerMemory:
    """The stores of one player, in ``folder``. ``clock`` is injectable for deterministic tests."""

    def __init__(
        self,
        folder: Path,
        embedder: Embedder,
        clock: Clock = time.time,
        max_chars: int = 4000,
        weights: Weights = Weights(),
    ) -> None:
        if embedder.dim != EMBEDDING_DIM:
            raise InvalidEntry(
                f"embedder {embedder.name} gives {embedder.dim}-dim vectors; the stores hold {EMBEDDING_DIM}"
            )
        self.folder, self.embedder, self.clock = folder, embedder, clock
        self.max_chars, self.weights = max_chars, weights
        path = folder / PRIMARY_FILE
        self.primary = connect(path)
        migrate(self.primary, PRIMARY_MIGRATIONS, path)
        self._clasp: apsw.Connection | None = None
        self._indexes: dict[str, VectorIndex] = {}

    def _store(self, name: str) -> apsw.Connection:
        if name == "primary":
            return self.primary
        if self._clasp is None:
            self._clasp = open_clasp(self.folder)
        return self._clasp

    def has_clasp(self) -> bool:
        """Whether this player has a clasp store yet (without creating one)."""
        return self._clasp is not None or clasp_exists(self.folder)

    def _index(self, name: str) -> VectorIndex:
        if name not in self._indexes:
            self._indexes[name] = VectorIndex.load(self._store(name))
        return self._indexes[name]

    def write(
        self,
        text: str | bytes,
        speaker: str,
        memory_class: str,
        data_category: str,
        mode: Mode = Mode.REALWORLD,
        **fields: object,
    ) -> MemoryEntry:
        """Validate, embed and store one entry in one transaction; invalid input changes nothing."""
        return self.write_many(
            [
                {
                    "text": text,
                    "speaker": speaker,
                    "memory_class": memory_class,
                    "data_category": data_category,
                    **fields,
                }
            ],
            mode,
        )[0]

    def write_many(
        self, items: list[dict], mode: Mode = Mode.REALWORLD, vectors: np.ndarray | None = None
    ) -> list[MemoryEntry]:
        """Validate every item, embed them in one batch (unless ``vectors`` are given) and store them
        in one transaction: all or nothing."""
        mode = as_mode(mode)
        now = self.clock()
        entries = []
        for item in items:
            fields = dict(item)
            text = clean_text(fields.pop("text"), self.max_chars)
            if mode is Mode.IN_BETWEEN:  # what is said in the in-between belongs to the clasp channel
                fields["data_category"] = "clasp"
            elif fields.get("data_category") == "clasp":
                raise InvalidEntry(
                    "data_category: clasp entries are written only in IN_BETWEEN mode, to the "
                    "clasp store; primary (which syncs upstream) never holds them"
                )
            unknown = set(fields) - set(MemoryEntry.__dataclass_fields__) - {"text"}
            if unknown:
                raise InvalidEntry(
                    f"unknown entry fields {sorted(unknown)}; known: "
                    f"{', '.join(sorted(MemoryEntry.__dataclass_fields__))}"
                )
            if "source_ids" in fields:
                fields["source_ids"] = tuple(fields["source_ids"])
            entry = MemoryEntry(
                event_uid=str(fields.pop("event_uid", None) or uuid.uuid4()),
                text=text,
                created_at=now,
                updated_at=now,
                **fields,
            )
            validate(entry)
            entries.append(entry)
        if vectors is None:
            vectors = self.embedder.embed([e.text for e in entries])
        store = "clasp" if mode is Mode.IN_BETWEEN else "primary"
        db = self._store(store)
        rowids = []
        with db:
            duplicates = [
                e.event_uid
                for e in entries
                if db.execute("SELECT 1 FROM entries WHERE event_uid = ?", (e.event_uid,)).fetchone()
            ]
            if duplicates or len({e.event_uid for e in entries}) < len(entries):
                raise InvalidEntry(
                    f"event_uid already stored or repeated: {duplicates or 'within the batch'}"
                )
            for entry, vector in zip(entries, vectors, strict=True):
                db.execute(
                    f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                    entry.row(),
                )
                rowid = db.last_insert_rowid()
                db.execute(
                    "INSERT INTO entries_vec (rowid, embedding, memory_class, data_category) "
                    "VALUES (?, ?, ?, ?)",
                    (rowid, vector.astype(np.float32).tobytes(), entry.memory_class, entry.data_category),
                )
                rowids.append(rowid)
        if store in self._indexes:
            for rowid, entry, vector in zip(rowids, entries, vectors, strict=True):
                self._indexes[store].add(rowid, vector, entry.memory_class, entry.data_category)
        return entries

    def retrieve(
        self,
        query: str | np.ndarray,
        k: int = 8,
        mode: Mode = Mode.REALWORLD,
        classes: Iterable[str] | None = None,
        categories: Iterable[str] | None = None,
        exclude: Iterable[str] = (),
        min_relevance: float = -1.0,
    ) -> list[Retrieved]:
        """The top ``k`` entries for ``query`` by the combined score, from the stores ``mode`` allows;
        entries whose event_uid is in ``exclude`` (e.g. lines already in the prompt's conversation
        window) or whose relevance is below ``min_relevance`` are neither returned nor marked
        accessed (the floor applies before the top ``k``: a recent entry below it never takes a
        relevant one's place)."""
        mode = as_mode(mode)
        vector = query if isinstance(query, np.ndarray) else self.embedder.embed([query])[0]
        stores = ["primary", "clasp"] if mode is Mode.IN_BETWEEN else ["primary"]
        skip = set(exclude)
        now = self.clock()
        found: list[tuple[Retrieved, int]] = []
        for name in stores:
            for rowid, distance, row in self._candidates(name, vector, k + len(skip), classes, categories):
                entry = MemoryEntry.from_row(row)
                if entry.event_uid in skip:
                    continue
                relevance = max(0.0, 1.0 - distance)
                if relevance < min_relevance:
                    continue
                hours = max(0.0, now - (entry.last_access or entry.created_at)) / 3600
                recency = self.weights.recency_decay_per_hour**hours
                score = (
                    self.weights.relevance * relevance
                    + self.weights.importance * entry.importance
                    + self.weights.recency * recency
                )
                found.append((Retrieved(entry, name, score, relevance, recency), rowid))
        found.sort(key=lambda item: (-item[0].score, item[0].entry.event_uid))
        top = found[:k]
        for name in stores:
            ids = [rowid for hit, rowid in top if hit.store == name]
            if ids:
                db = self._store(name)
                try:
                    with db:
                        db.executemany(
                            "UPDATE entries SET access_count = access_count + 1, last_access = ? "
                            "WHERE id = ?",
                            [(now, i) for i in ids],
                        )
                except apsw.BusyError:  # another process writes: the read stands, its bookkeeping waits
                    log.warning("%s store busy: access counts of %d entries not updated", name, len(ids))
        return [
            replace(hit, entry=replace(hit.entry, access_count=hit.entry.access_count + 1, last_access=now))
            for hit, _ in top
        ]

    def _candidates(
        self,
        name: str,
        vector: np.ndarray,
        k: int,
        classes: Iterable[str] | None,
        categories: Iterable[str] | None,
    ) -> list[tuple[int, float, tuple]]:
        hits = self._index(name).search(
            vector,
            k * self.weights.candidate_factor,
            None if classes is None else list(classes),
            None if categories is None else list(categories),
        )
        db = self._store(name)
        out = []
        for rowid, distance in hits:
            row = db.execute(f"SELECT {', '.join(COLUMNS)} FROM entries WHERE id = ?", (rowid,)).fetchone()
            out.append((rowid, distance, row))
        return out

    def has(self, event_uid: str, mode: Mode = Mode.REALWORLD) -> bool:
        """Whether the store ``mode`` writes to holds ``event_uid`` (a retried write checks first)."""
        db = self._store("clasp" if as_mode(mode) is Mode.IN_BETWEEN else "primary")
        return db.execute("SELECT 1 FROM entries WHERE event_uid = ?", (event_uid,)).fetchone() is not None

    def session_entries(self, session_id: str, mode: Mode, limit: int) -> list[MemoryEntry]:
        """The newest ``limit`` entries of ``session_id`` in the store ``mode`` writes to (the clasp
        in IN_BETWEEN), newest first: an in-between conversation's lines live only there."""
        db = self._store("clasp" if as_mode(mode) is Mode.IN_BETWEEN else "primary")
        rows = db.execute(
            f"SELECT {', '.join(COLUMNS)} FROM entries WHERE session_id = ? "
            "ORDER BY created_at DESC, id DESC LIMIT ?",
            (session_id, limit),
        )
        return [MemoryEntry.from_row(row) for row in rows]

    def entries(self, categories: Iterable[str] | None = None) -> list[MemoryEntry]:
        """Every primary entry (optionally of some categories). Never reads the clasp store."""
        sql, params = f"SELECT {', '.join(COLUMNS)} FROM entries", []
        if categories is not None:
            values = list(categories)
            sql += f" WHERE data_category IN ({', '.join('?' * len(values))})" if values else " WHERE 0"
            params = values
        return [MemoryEntry.from_row(row) for row in self.primary.execute(sql + " ORDER BY id", params)]

    def delete(self, event_uids: list[str]) -> None:
        """Remove primary entries (and their vectors) by event_uid, in one transaction."""
        if not event_uids:
            return
        removed = set()
        with self.primary:
            for uid in event_uids:
                row = self.primary.execute("SELECT id FROM entries WHERE event_uid = ?", (uid,)).fetchone()
                if row:
                    self.primary.execute("DELETE FROM entries_vec WHERE rowid = ?", (row[0],))
                    self.primary.execute("DELETE FROM entries WHERE id = ?", (row[0],))
                    removed.add(row[0])
        if "primary" in self._indexes:
            self._indexes["primary"].remove(removed)

    def character_death(self, working: str = "blur") -> dict[str, list[str]]:
        """The design's death rules ("Memory classes and pruning", "The clasp store"): cornerstone
        and birthright stay; volatile memories are lost; the clasp store is cleared; working
        memories follow ``working`` (the design's "lose, blur, or transform"):

        - ``"lose"``: they go;
        - ``"blur"``: the later half of the words gives way to an ellipsis; same speaker;
        - ``"transform"``: the words survive whole but change kind: re-framed as a half-remembered
          dream (speaker ``dream``, the text says "someone" said it, semantic type ``episode``),
          so the character can no longer cite them as fact or say who said them.

        Blurred and transformed memories keep their event_uid, source_ids, session, data
        category (the consent boundary: a death never moves a memory into another sharing
        category) and trait profile (identity drift stays the decay's business); importance and
        valence are damped by :data:`DEATH_DAMPING`. The clasp store is opened first, so a death
        that cannot reach it (open elsewhere, a wrong key) changes nothing; then primary changes
        in one transaction and the clasp is cleared. Returns the event_uids per outcome."""
        from nimmer_train.memory.clasp import clear_clasp

        rules = {"lose": None, "blur": _blurred, "transform": _transformed}
        if working not in rules:
            raise NimmerError(f"working-memory death rule {working!r}; known: {', '.join(rules)}")
        clasp = self._store("clasp") if self.has_clasp() else None  # raises before anything changed
        entries = self.entries()
        lost = [
            e.event_uid
            for e in entries
            if e.memory_class == "volatile" or (e.memory_class == "working" and working == "lose")
        ]
        changed = [e for e in entries if e.memory_class == "working" and working != "lose"]
        try:
            with self.primary:
                self.delete(lost + [e.event_uid for e in changed])
                if changed:
                    self.write_many([rules[working](e, self.max_chars) for e in changed])
        except BaseException:
            self._indexes.pop("primary", None)  # rolled back: reloaded from the store when next read
            raise
        if clasp is not None:
            clear_clasp(clasp)
            self._indexes.pop("clasp", None)
        kept = [e.event_uid for e in entries if e.memory_class in ("cornerstone", "birthright")]
        out = {"lost": sorted(lost), "blurred": [], "transformed": [], "kept": sorted(kept)}
        if changed:
            out["blurred" if working == "blur" else "transformed"] = sorted(e.event_uid for e in changed)
        return out

    def respawn(self) -> list[MemoryEntry]:
        """Restore the starting state the birthright defines: its entries (locked, never lost) with
        their access history reset as at creation. Returns them."""
        with self.primary:
            self.primary.execute(
                "UPDATE entries SET access_count = 0, last_access = NULL WHERE memory_class = 'birthright'"
            )
        return [e for e in self.entries() if e.memory_class == "birthright"]

    def close(self) -> None:
        self.primary.close()
        if self._clasp is not None:
            self._clasp.close()


DEATH_DAMPING = 0.5  # importance and valence of a working memory that outlives its character


def _after_death(entry: MemoryEntry, text: str, **changes: object) -> dict[str, object]:
    """A working memory rewritten by a death rule: same event, provenance and category, damped."""
    return {
        "text": text,
        "speaker": entry.speaker,
        "memory_class": "working",
        "data_category": entry.data_category,
        "event_uid": entry.event_uid,
        "semantic_type": entry.semantic_type,
        "trait_engagement": entry.trait_engagement,
        "emotional_valence": entry.emotional_valence * DEATH_DAMPING,
        "importance": entry.importance * DEATH_DAMPING,
        "source_ids": entry.source_ids,
        "session_id": entry.session_id,
        **changes,
    }


def _blurred(entry: MemoryEntry, max_chars: int) -> dict[str, object]:
    """Blur: the first half of its words, then an ellipsis."""
    words = entry.text.split()
    return _after_death(entry, " ".join(words[: max(1, (len(words) + 1) // 2)]) + " ...")


def _transformed(entry: MemoryEntry, max_chars: int) -> dict[str, object]:
    """Transform: the whole words, as a half-remembered dream of something someone said."""
    frame = 'A half-remembered dream: someone said, "{}"'
    room = max_chars - len(frame.format(""))
    words = entry.text if len(entry.text) <= room else entry.text[: room - 3] + "..."
    return _after_death(entry, frame.format(words), speaker="dream", semantic_type="episode")
