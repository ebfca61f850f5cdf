"""An agent's long-term memory on the device: :class:`AgentMemory`, the crystal store of its
folder (crystal_store.py) with the Python API of the memory tools on top: memory_search and
memory_get (recall.py), working_memory_note and memory_status (here).

The two here compose the modules that build on the store, so they sit above them: a note is
appended to the scratch file and ingested from there (ingestion.py), and the status reports
curiosity's targets and the dream engine's gate (curiosity.py, dreams.py). The tool registry
over this API is tools.py.
"""

from __future__ import annotations

import numpy as np

from nimmer_train.agent import curiosity, recall
from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.crystals import ACTIVE, EDGES
from nimmer_train.agent.dreams import DreamEngine
from nimmer_train.agent.ingestion import ingest_file
from nimmer_train.agent.scratch import NOTE_TYPES, SCRATCH, note_spec, scratch_line
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import get_meta
from nimmer_train.memory.player_memory import Mode, as_mode


class AgentMemory(CrystalStore):
    """The crystals of one agent folder and the memory tools' Python API over them."""

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
        """See :func:`nimmer_train.agent.recall.memory_search`."""
        return recall.memory_search(
            self,
            query,
            max_results,
            min_score,
            mode,
            include_superseded,
            include_expired,
            vector,
            use_text,
            record_access,
        )

    def memory_get(self, path: str, start: int = 1, lines: int | None = None) -> dict[str, object]:
        """See :func:`nimmer_train.agent.recall.memory_get`."""
        return recall.memory_get(self, path, start, lines)

    def working_memory_note(
        self, note: str, importance_: float = 0.7, kind: str = "experience", mode: Mode = Mode.REALWORLD
    ) -> dict[str, object]:
        """See :func:`working_memory_note`."""
        return working_memory_note(self, note, importance_, kind, mode)

    def memory_status(self, mode: Mode = Mode.REALWORLD) -> dict[str, object]:
        """See :func:`memory_status`."""
        return memory_status(self, mode)


def working_memory_note(
    agent: CrystalStore,
    note: str,
    importance_: float = 0.7,
    kind: str = "experience",
    mode: Mode = Mode.REALWORLD,
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
    now = agent.clock()
    line = scratch_line(now, note, importance_, kind)
    if mode is Mode.IN_BETWEEN:
        spec = note_spec(line, None, None, now)
        ids = agent.add([spec], mode)
        agent.settle_directives("clasp", ids)
        return {"stored": "clasp", "id": agent.uid("clasp", ids[0]), "file": None}
    with agent.lock:
        scratch = agent.folder / SCRATCH
        scratch.parent.mkdir(parents=True, exist_ok=True)
        existing = scratch.read_bytes() if scratch.exists() else b""
        prefix = b"" if not existing or existing.endswith(b"\n") else b"\n"
        with scratch.open("ab") as handle:
            handle.write(prefix + line.encode("utf-8") + b"\n")
        report = ingest_file(agent, SCRATCH)
    line_no = len((existing + prefix).decode("utf-8", "replace").splitlines()) + 1
    row = (
        agent.db("primary")
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


def memory_status(agent: CrystalStore, mode: Mode = Mode.REALWORLD) -> dict[str, object]:
    """Lifecycle counts, consolidation times, scheduler budgets, ingestion backlog, governance
    stats, goals and the user profile (live directives), curiosity's open targets and the dream
    engine's state. Nothing of the clasp store unless ``mode`` is IN_BETWEEN (not even its last
    consolidation report)."""
    with agent.lock:  # the stores' connections are shared with the watcher and indexer threads
        return _status(agent, mode)


def _status(agent: CrystalStore, mode: Mode) -> dict[str, object]:
    db = agent.db("primary")
    stores = {store: _store_status(agent, store) for store in agent.stores(mode)}
    active = f"c.lifecycle IN {ACTIVE} AND c.valid_to IS NULL"
    goals = agent.crystals("primary", f"e.semantic_type = 'goal' AND {active}")
    stalled = {
        r[0] for r in db.execute(f"SELECT entry_id FROM crystals c WHERE stalled_at IS NOT NULL AND {active}")
    }
    profile = [
        c.text
        for store in agent.stores(mode)
        for c in agent.crystals(store, "c.directive = 1 AND c.valid_to IS NULL AND c.lifecycle != 'expired'")
    ]
    return {
        "stores": stores,
        "consolidation": _consolidation_status(agent, "clasp" in stores),
        "scheduler": agent.scheduler_info(),
        "ingestion_backlog": agent.ingestion_backlog(),
        "goals": [{"id": g.id, "text": g.text, "stalled": g.entry_id in stalled} for g in goals],
        "user_profile": profile,
        "searches_logged": db.execute("SELECT count(*) FROM memory_search_log").fetchone()[0],
        "hormonalState": agent.hormones.state(agent.clock()),
        **_dream_status(agent),
    }


def _dream_status(agent: CrystalStore) -> dict[str, object]:
    """memory_status's ``curiosity`` (open targets) and ``dreams`` (gate, last cycle, counts)."""
    state = curiosity.curiosity_state(agent)
    return {
        "curiosity": {"targets": state["targets"], "regions": len(state["regions"])},
        "dreams": DreamEngine(agent).status(),
    }


def _store_status(agent: CrystalStore, store: str) -> dict[str, object]:
    """One store's lifecycle counts, superseded count and governance (lifespans, forgetting)."""
    sdb = agent.db(store)
    counts = dict.fromkeys(EDGES, 0)
    counts.update(dict(sdb.execute("SELECT lifecycle, count(*) FROM crystals GROUP BY lifecycle")))
    governance = dict(
        sdb.execute("SELECT lifespan, count(*) FROM crystals WHERE lifecycle != 'expired' GROUP BY lifespan")
    )

    def audited(like: str) -> int:
        return sdb.execute(f"SELECT count(*) FROM crystal_audit WHERE reason {like}").fetchone()[0]

    return {
        "lifecycle": counts,
        "superseded": sdb.execute("SELECT count(*) FROM crystals WHERE valid_to IS NOT NULL").fetchone()[0],
        "governance": {
            "lifespan": governance,
            "expired_by_ttl": audited("= 'ttl elapsed'"),
            "forgotten": audited("LIKE 'forgotten%'"),
            "merged": audited("LIKE 'merged into%'"),
        },
    }


def _consolidation_status(agent: CrystalStore, with_clasp: bool) -> dict[str, object]:
    """The last consolidation, the next one due, and the last report (its clasp part only
    ``with_clasp``: the clasp store keeps its own)."""
    db = agent.db("primary")
    last = get_meta(db, "last_consolidation")
    interval = get_meta(db, "consolidation_interval_s", 1800.0)
    report = get_meta(db, "last_consolidation_report")
    if isinstance(report, dict):  # primary's part (a report written before issue 26 held the clasp's)
        report = {k: v for k, v in report.items() if k != "clasp"}
        mine = get_meta(agent.db("clasp"), "last_consolidation_report") if with_clasp else None
        if mine is not None:
            report["clasp"] = mine
    return {
        "last": last,
        "next": None if last is None else last + interval,  # type: ignore[operator]
        "last_report": report,
    }
