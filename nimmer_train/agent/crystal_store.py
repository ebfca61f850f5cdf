"""The crystal store of one agent folder: its connections, live vector indexes, writer lock and
hormones, and every write (new crystals, lifecycle moves, directives that supersede older ones).

The agent folder is a player folder (primary.sqlite, and the clasp store through the clasp module)
plus the agent's workspace: ``MEMORY.md``, ``memory/*.md`` and ``skills/``. In REALWORLD mode
crystals are written to primary and searched there; in IN_BETWEEN mode they are written to the
clasp store only and search reads both (the rule of :mod:`nimmer_train.memory.player_memory`).
Ingestion, consolidation, curiosity and dreams work through this class; the memory tools' Python
API sits above them in agent_memory.py.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import apsw
import numpy as np

from nimmer_train.agent.crystals import (
    CRYSTAL_SELECT,
    LIFECYCLES,
    Crystal,
    CrystalSpec,
    content_hash,
    crystal_from_row,
    infer_semantic_type,
    supersede,
    transition,
)
from nimmer_train.agent.hormones import STORE as HORMONE_STORE
from nimmer_train.agent.hormones import Hormones
from nimmer_train.agent.importance import ImportancePolicy, importance, never_decays
from nimmer_train.agent.search import GONE, LIVE, SUPERSEDED, LiveIndex, SearchWeights
from nimmer_train.errors import NimmerError
from nimmer_train.memory.embedding import Embedder
from nimmer_train.memory.player_memory import Mode, PlayerMemory, as_mode

DIRECTIVE_CONFLICT = 0.6  # cosine between two directives above which the newer supersedes
Clock = Callable[[], float]
_SET_CRYSTAL = (
    "UPDATE crystals SET lifecycle = ?, origin = ?, path = ?, start_line = ?, "
    "end_line = ?, turn_ids = ?, content_hash = ?, lifespan = ?, ttl_s = ?, "
    "valid_from = ?, directive = ?, importance = ? WHERE entry_id = ?"
)


class CrystalStore:
    """The crystals of one agent folder. ``clock`` gives ``now`` (game time or a test clock)."""

    def __init__(
        self,
        folder: Path,
        embedder: Embedder,
        clock: Clock = time.time,
        data_category: str = "companion_session",
        weights: SearchWeights | None = None,
        policy: ImportancePolicy | None = None,
    ) -> None:
        self.folder = Path(folder)
        self.memory = PlayerMemory(self.folder, embedder, clock=clock)
        self.embedder, self.clock = embedder, clock
        self.data_category = data_category
        self.weights, self.policy = weights or SearchWeights(), policy or ImportancePolicy()
        self._indexes: dict[str, LiveIndex] = {}
        self.lock = threading.RLock()  # one writer per process: tools, watcher and indexer threads
        # memory_status's reports of the threads that feed this store (the watcher, the scheduler)
        self.ingestion_backlog: Callable[[], dict[str, int]] = lambda: {}
        self.scheduler_info: Callable[[], dict[str, object]] = lambda: {}
        self._hormones: Hormones | None = None

    # -- hormones (issue 17) -------------------------------------------------------------------
    @property
    def hormones(self) -> Hormones:
        """The agent's hormones (``hormones.sqlite`` in its folder, opened on first use)."""
        with self.lock:
            if self._hormones is None:
                self._hormones = Hormones(self.folder, self.clock)
            return self._hormones

    def search_weights(self, now: float) -> SearchWeights:
        """The search weights as the hormones modulate them at ``now``: importance x (1 + 0.2 D),
        recency x (1 + 0.3 C), both relative to rest (see hormones.py). An agent whose hormones
        were never stored is at rest, so its weights are the configured ones."""
        if self._hormones is None and not (self.folder / HORMONE_STORE).exists():
            return self.weights
        m = self.hormones.modulation(now)
        return dataclasses.replace(
            self.weights,
            importance=self.weights.importance * m.importance_factor,
            recency=self.weights.recency * m.recency_factor,
        )

    # -- stores -------------------------------------------------------------------------------
    def db(self, store: str) -> apsw.Connection:
        return self.memory._store(store)

    def stores(self, mode: Mode | str) -> list[str]:
        return ["primary", "clasp"] if as_mode(mode) is Mode.IN_BETWEEN else ["primary"]

    def existing_stores(self) -> list[str]:
        """primary, and the clasp store when this agent has one (consolidation tends both)."""
        return ["primary"] + (["clasp"] if self.memory.has_clasp() else [])

    def index(self, store: str) -> LiveIndex:
        if store not in self._indexes:
            self._indexes[store] = LiveIndex()
            self._indexes[store].load(self.db(store))
        else:
            self._indexes[store].refresh(self.db(store))
        return self._indexes[store]

    def after_commit(self, store: str) -> None:
        """Our own commit changed data_version for no one else; keep the index's mark current."""
        if store in self._indexes:
            self._indexes[store].data_version = self.db(store).execute("PRAGMA data_version").fetchone()[0]

    # -- writing -------------------------------------------------------------------------------
    def add(
        self, specs: Sequence[CrystalSpec], mode: Mode = Mode.REALWORLD, vectors: np.ndarray | None = None
    ) -> list[int]:
        """Store new crystals (embedded in one batch) in one transaction; returns their entry ids."""
        mode = as_mode(mode)  # "in_between" and Mode.IN_BETWEEN both write clasp
        if not specs:
            return []
        for spec in specs:
            spec.check()
        store = "clasp" if mode is Mode.IN_BETWEEN else "primary"
        now = self.clock()
        types = [s.semantic_type or infer_semantic_type(s.text, s.origin) for s in specs]
        items = [_entry(s, kind, self.data_category) for s, kind in zip(specs, types, strict=True)]
        if vectors is None:
            vectors = self.embedder.embed([s.embed_text or s.text for s in specs])
        with self.lock:
            db = self.db(store)
            index = self.index(store)
            with db:
                entries = self.memory.write_many(items, mode, vectors)
                ids = []
                for spec, entry, kind in zip(specs, entries, types, strict=True):
                    entry_id = db.execute(
                        "SELECT id FROM entries WHERE event_uid = ?", (entry.event_uid,)
                    ).fetchone()[0]
                    db.execute(_SET_CRYSTAL, (*_crystal_fields(spec, kind, now, self.policy), entry_id))
                    if spec.origin == "skill":  # born frozen: the creation audit row says so
                        db.execute(
                            "UPDATE crystal_audit SET to_state = 'frozen' "
                            "WHERE entry_id = ? AND from_state IS NULL",
                            (entry_id,),
                        )
                    ids.append(entry_id)
            for entry_id, vector, spec in zip(ids, vectors, specs, strict=True):
                index.add(entry_id, vector, LIVE, now if spec.valid_from is None else spec.valid_from)
            self.after_commit(store)
        return ids

    def move(self, store: str, entry_ids: Iterable[int], to: str, reason: str) -> int:
        """Transition crystals (skipping those already there) in one transaction; returns how many moved."""
        if to not in LIFECYCLES:
            raise NimmerError(f"lifecycle: {to!r} is not one of {', '.join(LIFECYCLES)}")
        now = self.clock()
        moved = 0
        with self.lock:
            db = self.db(store)
            index = self.index(store)
            with db:
                for entry_id in entry_ids:
                    row = db.execute(
                        "SELECT lifecycle FROM crystals WHERE entry_id = ?", (entry_id,)
                    ).fetchone()
                    if row is None or row[0] == to:
                        continue
                    transition(db, entry_id, to, reason, now)
                    moved += 1
            if to in ("archived", "expired"):
                for entry_id in entry_ids:
                    index.set_state(entry_id, GONE)
            self.after_commit(store)
        return moved

    def settle_directives(self, store: str, new_ids: Iterable[int]) -> int:
        """Each new directive closes the validity of older live directives it conflicts with."""
        closed = 0
        with self.lock:
            db, index = self.db(store), self.index(store)
            now = self.clock()
            with db:
                for new_id in new_ids:
                    vec = index.vector(new_id)
                    if vec is None:
                        continue
                    older = [
                        r[0]
                        for r in db.execute(
                            "SELECT entry_id FROM crystals WHERE directive = 1 AND valid_to IS NULL "
                            "AND entry_id != ? AND entry_id < ? AND lifecycle NOT IN ('archived', 'expired')",
                            (new_id, new_id),
                        )
                    ]
                    for old_id, sim in index.similarity(vec, older).items():
                        if sim >= DIRECTIVE_CONFLICT:
                            supersede(db, old_id, new_id, now)
                            index.set_state(old_id, SUPERSEDED)
                            closed += 1
            self.after_commit(store)
        return closed

    # -- reading -------------------------------------------------------------------------------
    def crystals(
        self, store: str = "primary", where: str = "1", params: Sequence[object] = ()
    ) -> list[Crystal]:
        sql = f"{CRYSTAL_SELECT} WHERE {where} ORDER BY e.id"
        with self.lock:
            return [crystal_from_row(r, store) for r in self.db(store).execute(sql, params)]

    def uid(self, store: str, entry_id: int) -> str:
        """The event uid (the id the tools show) of an entry id."""
        return self.db(store).execute("SELECT event_uid FROM entries WHERE id = ?", (entry_id,)).fetchone()[0]

    def close(self) -> None:
        self.memory.close()
        if self._hormones is not None:
            self._hormones.close()


def _entry(spec: CrystalSpec, kind: str, data_category: str) -> dict[str, object]:
    """The player-store entry of a crystal (its text, speaker and class; the crystal row follows)."""
    return {
        "text": spec.text,
        "speaker": spec.speaker,
        "memory_class": spec.memory_class,
        "data_category": data_category,
        "semantic_type": kind,
        "emotional_valence": spec.emotional_valence,
        "importance": spec.importance,
        "session_id": spec.session_id,
        "source_ids": spec.source_ids,
        **spec.entry_fields,
    }


def _crystal_fields(spec: CrystalSpec, kind: str, now: float, policy: ImportancePolicy) -> tuple:
    """The crystal row of a new entry (``_SET_CRYSTAL`` without its entry id); a skill is born frozen."""
    frozen = spec.origin == "skill"
    lifecycle = "frozen" if frozen else "generated"
    lifespan = "permanent" if frozen else spec.lifespan
    decays = not never_decays(lifecycle, lifespan, spec.memory_class)
    value = importance(kind, 0, 0.0, spec.emotional_valence, spec.importance, decays, policy)
    return (
        lifecycle,
        spec.origin,
        spec.path,
        spec.start_line,
        spec.end_line,
        json.dumps(list(spec.turn_ids)),
        spec.source_hash or content_hash(spec.text),
        lifespan,
        spec.ttl_s,
        now if spec.valid_from is None else spec.valid_from,
        int(spec.directive),
        value,
    )
