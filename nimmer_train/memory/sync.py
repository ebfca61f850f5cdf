"""The sync boundary of a player's stores.

- logout: the session ends, so a prune pass runs (volatile memories of the session go, decayed
  working ones too); then the upstream prune-blob (what remains in primary, no vectors) and a
  snapshot of primary.sqlite to fallback.sqlite through SQLite's online backup API;
- login: back-write fragments applied by event_uid, idempotently;
- start-up: integrity_check of primary; when it fails (or the file cannot be opened at all),
  primary is restored from fallback and the report names the loss window: everything written
  after the last snapshot.

The clasp store takes no part: nothing here opens it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import apsw

from nimmer_train.memory.db import connect, integrity_ok
from nimmer_train.memory.embedding import Embedder
from nimmer_train.memory.player_memory import PRIMARY_FILE, Clock, PlayerMemory

FALLBACK_FILE = "fallback.sqlite"
SNAPSHOT_META = (
    "CREATE TABLE IF NOT EXISTS snapshot_meta (id INTEGER PRIMARY KEY CHECK (id = 1), taken_at REAL)"
)


@dataclass(frozen=True)
class StartupReport:
    restored: bool
    reason: str = ""
    lost_after: float | None = None  # writes after this time (the last snapshot) were lost

    def __str__(self) -> str:
        if not self.restored:
            return "primary store intact"
        when = (
            time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(self.lost_after)) if self.lost_after else "never"
        )
        return f"primary store restored from fallback ({self.reason}); writes after {when} UTC were lost"


def logout(memory: PlayerMemory, upstream: Path) -> Path:
    """Prune, write the upstream blob to ``upstream`` (JSON lines) and snapshot primary to fallback."""
    from nimmer_train.memory.consent import get_consent
    from nimmer_train.memory.pruning import prune

    prune(memory, current_session=None)
    excluded = set(get_consent(memory).excluded_categories)  # never upstream, whatever the tier
    entries = [e for e in memory.entries() if e.data_category not in excluded]
    tmp = upstream.with_suffix(".tmp")
    with open(tmp, "w") as fh:
        for entry in entries:
            fh.write(json.dumps({**entry.__dict__, "source_ids": list(entry.source_ids)}) + "\n")
    tmp.replace(upstream)
    snapshot(memory)
    return upstream


def snapshot(memory: PlayerMemory) -> None:
    """Copy primary into fallback.sqlite with the backup API and stamp the time."""
    target = connect(memory.folder / FALLBACK_FILE)
    with target.backup("main", memory.primary, "main") as backup:
        backup.step()  # the whole database in one step
    with target:
        target.execute(SNAPSHOT_META)
        target.execute("INSERT OR REPLACE INTO snapshot_meta VALUES (1, ?)", (memory.clock(),))
    target.close()


def login(memory: PlayerMemory, fragments: Iterable[dict]) -> int:
    """Apply back-written fragments under their event_uid (design "Dual-table redundancy +
    sync-on-auth"): a new event_uid is added; one already present whose text differs is merged
    (the Compositor's canon replaces the local working or volatile entry; cornerstone and
    birthright are never rewritten); an identical one is skipped. Returns how many were new."""
    local = {e.event_uid: e for e in memory.entries()}
    known = set(local)
    added = 0
    for fragment in fragments:
        if fragment["event_uid"] in known:
            mine = local.get(fragment["event_uid"])
            if (
                mine is None
                or mine.text == fragment["text"]
                or mine.memory_class not in ("working", "volatile")
            ):
                continue
            memory.delete([mine.event_uid])  # canon replaces it below, same event_uid
            added -= 1  # a merge, not a new event
        fields = {
            k: v
            for k, v in fragment.items()
            if k in ("semantic_type", "trait_engagement", "emotional_valence", "importance", "session_id")
        }
        memory.write(
            fragment["text"],
            fragment["speaker"],
            fragment["memory_class"],
            fragment["data_category"],
            event_uid=fragment["event_uid"],
            source_ids=tuple(fragment.get("source_ids", ())),
            **fields,
        )
        known.add(fragment["event_uid"])
        added += 1
    return added


def startup(folder: Path) -> StartupReport:
    """Check primary; restore it from fallback if it is damaged. Never raises on a bad primary."""
    primary = folder / PRIMARY_FILE
    if not primary.exists():
        return StartupReport(False)
    try:
        db = connect(primary)
        ok = integrity_ok(db)
        db.close()
        reason = "integrity_check failed"
    except apsw.Error as exc:
        ok, reason = False, f"cannot open: {exc.__class__.__name__}"
    if ok:
        return StartupReport(False)
    fallback = folder / FALLBACK_FILE
    for suffix in ("", "-wal", "-shm"):
        damaged = Path(f"{primary}{suffix}")
        if damaged.exists():
            damaged.replace(Path(f"{primary}.corrupt{suffix}"))  # kept for inspection, not reused
    if not fallback.exists():
        return StartupReport(True, reason + "; no fallback snapshot, starting empty", None)
    source = connect(fallback)
    taken = source.execute("SELECT taken_at FROM snapshot_meta WHERE id = 1").fetchone()
    target = connect(primary)
    with target.backup("main", source, "main") as backup:
        backup.step()
    target.close()
    source.close()
    return StartupReport(True, reason, taken[0] if taken else None)


def open_player(
    folder: Path, embedder: Embedder, clock: Clock = time.time
) -> tuple[PlayerMemory, StartupReport]:
    """Start-up check (and restore), then open the player's memory."""
    report = startup(folder)
    return PlayerMemory(folder, embedder, clock=clock), report
