"""An agent's long-term memory on the device: the crystals in its folder and the Python API of
the memory tools (memory_search, memory_get, memory_status, working_memory_note).

The agent folder is a player folder (primary.sqlite, and the clasp store through the clasp module)
plus the agent's workspace: ``MEMORY.md``, ``memory/*.md`` and ``skills/``. In REALWORLD mode
crystals are written to primary and searched there; in IN_BETWEEN mode they are written to the
clasp store only and search reads both (the rule of :mod:`nimmer_train.memory.player_memory`).
Ingestion, consolidation and the tool registry are in their own modules and work through this
class.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import apsw
import numpy as np

from nimmer_train.agent.crystals import (
    ACTIVE,
    CRYSTAL_SELECT,
    EDGES,
    LIFECYCLES,
    Crystal,
    CrystalSpec,
    content_hash,
    crystal_from_row,
    infer_semantic_type,
    load,
    supersede,
    transition,
)
from nimmer_train.agent.hormones import STORE as HORMONE_STORE
from nimmer_train.agent.hormones import Hormones
from nimmer_train.agent.importance import ImportancePolicy, importance, never_decays
from nimmer_train.agent.search import (
    GONE,
    LIVE,
    SUPERSEDED,
    LiveIndex,
    SearchWeights,
    fuse,
    keyword_ranked,
    recency,
    weighted,
)
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import get_meta
from nimmer_train.memory.embedding import Embedder
from nimmer_train.memory.player_memory import Mode, PlayerMemory, as_mode

SCRATCH = "memory/scratch.md"
NOTE_TYPES = {
    "experience": "episode",
    "directive": "preference",
    "world_fact": "fact",
    "mental_model": "insight",
}
DIRECTIVE_CONFLICT = 0.6  # cosine between two directives above which the newer supersedes
Clock = Callable[[], float]


def _iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def scratch_line(at: float, note: str, importance_: float, kind: str) -> str:
    """One scratch.md line; :func:`nimmer_train.agent.ingestion.parse_scratch` reads it back."""
    flat = " ".join(note.split())
    return f"- [{_iso(at)}] (importance: {importance_:.2f}, type: {kind}) {flat}"


class AgentMemory:
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
        recency x (1 + 0.3 C), both relative to rest (see memory/hormones.py). An agent whose
        hormones were never stored is at rest, so its weights are the configured ones."""
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

    def _after_commit(self, store: str) -> None:
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
        items = [
            {
                "text": s.text,
                "speaker": s.speaker,
                "memory_class": s.memory_class,
                "data_category": self.data_category,
                "semantic_type": kind,
                "emotional_valence": s.emotional_valence,
                "importance": s.importance,
                "session_id": s.session_id,
                "source_ids": s.source_ids,
                **s.entry_fields,
            }
            for s, kind in zip(specs, types, strict=True)
        ]
        if vectors is None:
            vectors = self.embedder.embed([s.text for s in specs])
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
                    frozen = spec.origin == "skill"
                    lifespan = "permanent" if frozen else spec.lifespan
                    decays = not never_decays(
                        "frozen" if frozen else "generated", lifespan, spec.memory_class
                    )
                    value = importance(
                        kind, 0, 0.0, spec.emotional_valence, spec.importance, decays, self.policy
                    )
                    db.execute(
                        "UPDATE crystals SET lifecycle = ?, origin = ?, path = ?, start_line = ?, "
                        "end_line = ?, turn_ids = ?, content_hash = ?, lifespan = ?, ttl_s = ?, "
                        "valid_from = ?, directive = ?, importance = ? WHERE entry_id = ?",
                        (
                            "frozen" if frozen else "generated",
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
                            entry_id,
                        ),
                    )
                    if frozen:  # born frozen: the creation audit row says so
                        db.execute(
                            "UPDATE crystal_audit SET to_state = 'frozen' "
                            "WHERE entry_id = ? AND from_state IS NULL",
                            (entry_id,),
                        )
                    ids.append(entry_id)
            for entry_id, vector in zip(ids, vectors, strict=True):
                index.add(entry_id, vector, LIVE)
            self._after_commit(store)
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
            self._after_commit(store)
        return moved

    # -- reading -------------------------------------------------------------------------------
    def crystals(
        self, store: str = "primary", where: str = "1", params: Sequence[object] = ()
    ) -> list[Crystal]:
        sql = f"{CRYSTAL_SELECT} WHERE {where} ORDER BY e.id"
        with self.lock:
            return [crystal_from_row(r, store) for r in self.db(store).execute(sql, params)]

    def memory_search(
        self,
        query: str,
        max_results: int = 6,
        min_score: float = 0.2,
        mode: Mode = Mode.REALWORLD,
        include_superseded: bool = False,
        include_expired: bool = False,
        vector: np.ndarray | None = None,
        use_text: bool = True,
        record_access: bool = True,
    ) -> list[dict[str, object]]:
        """Hybrid search (see search.py) over the stores ``mode`` allows; logs the search and
        counts an access on every hit (a generated crystal becomes activated)."""
        if not query.strip():
            raise NimmerError("query: empty; say what to search for")
        if max_results < 1:
            raise NimmerError(f"maxResults: {max_results} must be at least 1")
        mode = as_mode(mode)
        q = self.embedder.embed([query])[0] if vector is None else vector
        now = self.clock()
        w = self.search_weights(now)
        hits: list[tuple[float, float, str, int]] = []
        with self.lock:
            for store in self.stores(mode):
                db, index = self.db(store), self.index(store)
                mask = index.mask(include_superseded, include_expired)
                n = w.candidates * max_results
                by_vector = index.nearest(q, n, mask)
                n_text = w.text_candidates * max_results
                by_text = (
                    keyword_ranked(db, index, query, n_text, mask, w.text_min_idf_share) if use_text else []
                )
                fused = fuse(by_vector, by_text, w)
                keyword_hits = {i for i, _ in by_text}
                sims = dict(by_vector)
                sims.update(index.similarity(q, [i for i in keyword_hits if i not in sims]))
                rows = (
                    {
                        r[0]: r[1:]
                        for r in db.execute(
                            f"SELECT entry_id, valid_from, importance, valid_to IS NOT NULL FROM crystals "
                            f"WHERE entry_id IN "
                            f"({', '.join('?' * len(fused))})",
                            list(fused),
                        )
                    }
                    if fused
                    else {}
                )
                stale = set(fused) - set(rows)  # deleted on this connection (issue 5's pruning)
                if stale:
                    index.remove(stale)
                for entry_id, value in fused.items():
                    if entry_id in stale:
                        continue
                    valid_from, imp, closed = rows[entry_id]
                    score = weighted(value, recency(valid_from, now, w.recency_half_life_h), imp, w, closed)
                    if sims.get(entry_id, 0.0) >= min_score or entry_id in keyword_hits:
                        hits.append((score, sims.get(entry_id, 0.0), store, entry_id))
            hits.sort(key=lambda h: (-h[0], h[2], h[3]))
            hits = hits[:max_results]
            found: list[dict[str, object]] = []
            log_store = "clasp" if mode is Mode.IN_BETWEEN else "primary"  # a clasp query stays in clasp
            for store in self.stores(mode):
                mine = [h for h in hits if h[2] == store]
                crystals = load(self.db(store), [h[3] for h in mine], store)
                self._bookkeep(
                    store, mine, crystals, hits if store == log_store else None, query, now, record_access
                )
                self._after_commit(store)
                for h in mine:
                    found.append((h, crystals[h[3]]))  # type: ignore[arg-type]
        found.sort(key=lambda pair: (-pair[0][0], pair[0][2], pair[0][3]))  # type: ignore[index]
        out = []
        for (score, sim, _store, _id), crystal in found:  # type: ignore[misc]
            item = crystal.public()
            item.update(score=round(score, 6), similarity=round(sim, 6))
            if crystal.path and crystal.start_line:
                item["citation"] = f"{crystal.path}#L{crystal.start_line}-L{crystal.end_line}"
            out.append(item)
        return out

    def _bookkeep(
        self,
        store: str,
        mine: list[tuple[float, float, str, int]],
        crystals: dict[int, Crystal],
        logged: list[tuple[float, float, str, int]] | None,
        query: str,
        now: float,
        record_access: bool,
    ) -> None:
        """Count accesses on ``mine`` (generated -> activated) and log the search (``logged``).

        Soft state, so committed without an fsync (WAL, synchronous=NORMAL: the store stays
        consistent after a crash, the last few counts may be lost); a search stays fast.
        """
        db = self.db(store)
        db.execute("PRAGMA synchronous=NORMAL")
        try:
            with db:
                if record_access and mine:
                    db.executemany(
                        "UPDATE entries SET access_count = access_count + 1, last_access = ? WHERE id = ?",
                        [(now, h[3]) for h in mine],
                    )
                    for h in mine:
                        if crystals[h[3]].lifecycle == "generated":
                            transition(db, h[3], "activated", "retrieved by memory_search", now)
                if logged is not None:
                    scores, sims = [h[0] for h in logged], [h[1] for h in logged]
                    db.execute(
                        "INSERT INTO memory_search_log (at, query, results, top_score, mean_score, "
                        "top_similarity, mean_similarity) VALUES (?, ?, ?, ?, ?, ?, ?)",
                        (
                            now,
                            query,
                            len(logged),
                            max(scores, default=None),
                            float(np.mean(scores)) if scores else None,
                            max(sims, default=None),
                            float(np.mean(sims)) if sims else None,
                        ),
                    )
        finally:
            db.execute("PRAGMA synchronous=FULL")

    def memory_get(self, path: str, start: int = 1, lines: int | None = None) -> dict[str, object]:
        """Exact lines of a workspace memory file: ``lines`` lines from line ``start`` (1-based)."""
        target = self.workspace_file(path)
        if start < 1:
            raise NimmerError(f"from: {start} must be 1 or more (lines are numbered from 1)")
        if lines is not None and lines < 1:
            raise NimmerError(f"lines: {lines} must be 1 or more")
        try:
            all_lines = target.read_bytes().decode("utf-8").splitlines()
        except FileNotFoundError as exc:
            raise NimmerError(f"path: {path} does not exist in {self.folder}") from exc
        except UnicodeDecodeError as exc:
            raise NimmerError(f"path: {path} is not valid UTF-8 (byte {exc.start})") from exc
        end = len(all_lines) if lines is None else min(len(all_lines), start - 1 + lines)
        chosen = all_lines[start - 1 : end]
        return {"path": path, "from": start, "lines": len(chosen), "text": "\n".join(chosen)}

    def workspace_file(self, path: str) -> Path:
        """The file of a workspace path (MEMORY.md, memory/*.md, skills/...); nothing outside."""
        relative = Path(path)
        if relative.is_absolute() or ".." in relative.parts:
            raise NimmerError(f"path: {path!r} must be relative to the agent folder, without '..'")
        if not (relative == Path("MEMORY.md") or relative.parts[0] in ("memory", "skills")):
            raise NimmerError(f"path: {path!r} is not a memory file (MEMORY.md, memory/*.md or skills/...)")
        return self.folder / relative

    # -- notes ---------------------------------------------------------------------------------
    def working_memory_note(
        self, note: str, importance_: float = 0.7, kind: str = "experience", mode: Mode = Mode.REALWORLD
    ) -> dict[str, object]:
        """Persist a note: searchable at once; a directive supersedes the conflicting older one.

        REALWORLD: appended to memory/scratch.md and ingested from there (the file stays the
        source of truth). IN_BETWEEN: a clasp crystal only; no file and nothing in primary.
        """
        mode = as_mode(mode)
        if kind not in NOTE_TYPES:
            raise NimmerError(f"type: {kind!r} is not one of {', '.join(NOTE_TYPES)}")
        if not 0 <= importance_ <= 1:
            raise NimmerError(f"importance: {importance_} is outside [0, 1]")
        if not note.strip():
            raise NimmerError("note: empty; say what to remember")
        now = self.clock()
        line = scratch_line(now, note, importance_, kind)
        if mode is Mode.IN_BETWEEN:
            spec = note_spec(line, None, None, now)
            ids = self.add([spec], mode)
            self.settle_directives("clasp", ids)
            return {"stored": "clasp", "id": self._uid("clasp", ids[0]), "file": None}
        from nimmer_train.agent.ingestion import ingest_file  # ingestion builds on this module

        with self.lock:
            scratch = self.folder / SCRATCH
            scratch.parent.mkdir(parents=True, exist_ok=True)
            existing = scratch.read_bytes() if scratch.exists() else b""
            prefix = b"" if not existing or existing.endswith(b"\n") else b"\n"
            with scratch.open("ab") as handle:
                handle.write(prefix + line.encode("utf-8") + b"\n")
            report = ingest_file(self, SCRATCH)
        line_no = len((existing + prefix).decode("utf-8", "replace").splitlines()) + 1
        row = (
            self.db("primary")
            .execute(
                "SELECT e.event_uid FROM crystals c JOIN entries e ON e.id = c.entry_id WHERE c.path = ? "
                "AND c.start_line = ? AND c.lifecycle != 'expired' ORDER BY e.id DESC LIMIT 1",
                (SCRATCH, line_no),
            )
            .fetchone()
        )
        return {
            "stored": "primary",
            "id": row[0] if row else None,
            "file": SCRATCH,
            "line": line_no,
            **report,
        }

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
            self._after_commit(store)
        return closed

    def _uid(self, store: str, entry_id: int) -> str:
        return self.db(store).execute("SELECT event_uid FROM entries WHERE id = ?", (entry_id,)).fetchone()[0]

    # -- status --------------------------------------------------------------------------------
    def memory_status(self, mode: Mode = Mode.REALWORLD) -> dict[str, object]:
        """Lifecycle counts, consolidation times, scheduler budgets, ingestion backlog, governance
        stats, goals and the user profile (live directives). Nothing of the clasp store unless
        ``mode`` is IN_BETWEEN (not even its last consolidation report)."""
        with self.lock:  # the stores' connections are shared with the watcher and indexer threads
            return self._status(mode)

    def _status(self, mode: Mode) -> dict[str, object]:
        db = self.db("primary")
        stores = {}
        for store in self.stores(mode):
            sdb = self.db(store)
            counts = dict.fromkeys(EDGES, 0)
            counts.update(dict(sdb.execute("SELECT lifecycle, count(*) FROM crystals GROUP BY lifecycle")))
            governance = dict(
                sdb.execute(
                    "SELECT lifespan, count(*) FROM crystals WHERE lifecycle != 'expired' GROUP BY lifespan"
                )
            )
            stores[store] = {
                "lifecycle": counts,
                "superseded": sdb.execute(
                    "SELECT count(*) FROM crystals WHERE valid_to IS NOT NULL"
                ).fetchone()[0],
                "governance": {
                    "lifespan": governance,
                    "expired_by_ttl": sdb.execute(
                        "SELECT count(*) FROM crystal_audit WHERE reason = 'ttl elapsed'"
                    ).fetchone()[0],
                    "forgotten": sdb.execute(
                        "SELECT count(*) FROM crystal_audit WHERE reason LIKE 'forgotten%'"
                    ).fetchone()[0],
                    "merged": sdb.execute(
                        "SELECT count(*) FROM crystal_audit WHERE reason LIKE 'merged into%'"
                    ).fetchone()[0],
                },
            }
        active = f"c.lifecycle IN {ACTIVE} AND c.valid_to IS NULL"
        goals = self.crystals("primary", f"e.semantic_type = 'goal' AND {active}")
        stalled = {
            r[0]
            for r in db.execute(f"SELECT entry_id FROM crystals c WHERE stalled_at IS NOT NULL AND {active}")
        }
        profile = [
            c.text
            for store in self.stores(mode)
            for c in self.crystals(
                store, "c.directive = 1 AND c.valid_to IS NULL AND c.lifecycle != 'expired'"
            )
        ]
        last = get_meta(db, "last_consolidation")
        interval = get_meta(db, "consolidation_interval_s", 1800.0)
        report = get_meta(db, "last_consolidation_report")
        if isinstance(report, dict):  # primary's part (a report written before issue 26 held the clasp's)
            report = {k: v for k, v in report.items() if k != "clasp"}
            mine = get_meta(self.db("clasp"), "last_consolidation_report") if "clasp" in stores else None
            if mine is not None:
                report["clasp"] = mine
        return {
            "stores": stores,
            "consolidation": {
                "last": last,
                "next": None if last is None else last + interval,  # type: ignore[operator]
                "last_report": report,
            },
            "scheduler": self.scheduler_info(),
            "ingestion_backlog": self.ingestion_backlog(),
            "goals": [{"id": g.id, "text": g.text, "stalled": g.entry_id in stalled} for g in goals],
            "user_profile": profile,
            "searches_logged": db.execute("SELECT count(*) FROM memory_search_log").fetchone()[0],
            "hormonalState": self.hormones.state(self.clock()),
            **_dream_status(self),
        }

    def close(self) -> None:
        self.memory.close()
        if self._hormones is not None:
            self._hormones.close()


def _dream_status(agent: AgentMemory) -> dict[str, object]:
    """memory_status's ``curiosity`` (open targets) and ``dreams`` (gate, last cycle, counts)."""
    from nimmer_train.agent import curiosity  # both build on this module
    from nimmer_train.agent.dreams import DreamEngine

    state = curiosity.curiosity_state(agent)
    return {
        "curiosity": {"targets": state["targets"], "regions": len(state["regions"])},
        "dreams": DreamEngine(agent).status(),
    }


def note_spec(line: str, path: str | None, line_no: int | None, now: float | None = None) -> CrystalSpec:
    """The crystal of one scratch line (see :func:`scratch_line`)."""
    match = re.match(r"- \[([^\]]+)\] \(importance: ([0-9.]+), type: (\w+)\) (.*)$", line)
    if match is None:
        raise NimmerError(f"{path}:{line_no}: not a scratch note line")
    kind = match.group(3) if match.group(3) in NOTE_TYPES else "experience"
    at = dt.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    return CrystalSpec(
        text=match.group(4),
        origin="note",
        semantic_type=NOTE_TYPES[kind],
        path=path,
        start_line=line_no,
        end_line=line_no,
        importance=min(1.0, float(match.group(2))),
        directive=kind == "directive",
        valid_from=at if now is None else now,
        source_hash=content_hash(line),
    )
