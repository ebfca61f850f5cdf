"""The sync boundary of a player's stores.

- logout: the session ends, so a prune pass runs (volatile memories of the session go, decayed
  working ones too); then the upstream prune-blob of the in-progress events (no vectors) and a
  snapshot of primary.sqlite to fallback.sqlite through SQLite's online backup API;
- login: back-write fragments applied by event_uid, idempotently;
- start-up: integrity_check of primary; when it fails (or the file cannot be opened at all),
  primary is restored from fallback and the report names the loss window: everything written
  after the last snapshot.

The clasp store takes no part: nothing here opens it.

In-progress events (design: "Graceful logout: push prune-blob for any in-progress events"): the
events whose canon the Compositor has not composed yet, seen from this device. An entry is in the
blob when it has no sync mark, i.e. it was written since the last graceful logout (each logout
marks every entry it saw ``sent`` or ``withheld``: a perspective is offered once, at the end of
the session it happened in) and no login back-wrote canon for its event_uid (marked ``canon``:
the event is composed, and canon is never echoed back); when it is working memory or cornerstone
(a vow or a loss is formed by an event, so its perspective belongs to that event's canon;
birthright is the character's starting state, not an event, and volatile memory is
session-bounded, so neither ever goes); and when its category is not excluded by consent.
Entries written in a session that ended ungracefully carry no mark, so they go at the next
graceful logout unless their canon came first. An exclusion lifted later sends nothing written
before it was lifted.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import apsw

from nimmer_train.artifacts import write_bytes_atomic
from nimmer_train.memory.db import connect, integrity_ok
from nimmer_train.memory.embedding import Embedder
from nimmer_train.memory.entries import MemoryEntry
from nimmer_train.memory.player_memory import PRIMARY_FILE, Clock, PlayerMemory

FALLBACK_FILE = "fallback.sqlite"
UPSTREAM_CLASSES = ("working", "cornerstone")  # event perspectives; birthright and volatile never
FRAGMENT_FIELDS = ("semantic_type", "trait_engagement", "emotional_valence", "importance", "session_id")
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


def in_progress(memory: PlayerMemory) -> tuple[list[MemoryEntry], list[MemoryEntry]]:
    """The entries of in-progress events (see the module docstring) and the other unmarked ones
    (excluded categories, birthright, volatile), which the next logout marks ``withheld``."""
    from nimmer_train.memory.consent import get_consent

    excluded = set(get_consent(memory).excluded_categories)  # never upstream, whatever the tier
    marked = {row[0] for row in memory.primary.execute("SELECT event_uid FROM sync_marks")}
    unmarked = [e for e in memory.entries() if e.event_uid not in marked]
    sent = [e for e in unmarked if e.memory_class in UPSTREAM_CLASSES and e.data_category not in excluded]
    uids = {e.event_uid for e in sent}
    return sent, [e for e in unmarked if e.event_uid not in uids]


def logout(memory: PlayerMemory, upstream: Path) -> Path:
    """Prune, write the upstream blob of the in-progress events to ``upstream`` (JSON lines,
    atomically), mark what this logout saw, and snapshot primary to fallback.

    A blob still at ``upstream`` was not pushed yet (the pusher removes it once sent: offline
    play), so its events are kept: the new blob is merged into it by event_uid (a new line
    replaces an old one of the same event), and marking ``sent`` at write time loses nothing."""
    from nimmer_train.memory.pruning import prune

    prune(memory, current_session=None)
    sent, withheld = in_progress(memory)
    lines = [json.dumps({**e.__dict__, "source_ids": list(e.source_ids)}) + "\n" for e in sent]
    earlier = _unpushed(upstream, {e.event_uid for e in sent})
    write_bytes_atomic(upstream, b"".join(earlier) + "".join(lines).encode())
    now = memory.clock()  # marked after the blob is on disk: a crash before resends, never drops
    with memory.primary:
        memory.primary.executemany(
            "INSERT OR IGNORE INTO sync_marks VALUES (?, ?, ?)",
            [(e.event_uid, "sent", now) for e in sent] + [(e.event_uid, "withheld", now) for e in withheld],
        )
        memory.primary.execute(
            "DELETE FROM sync_marks WHERE event_uid NOT IN (SELECT event_uid FROM entries)"
        )
    snapshot(memory)
    return upstream


def _unpushed(upstream: Path, replaced: set[str]) -> list[bytes]:
    """The lines of an earlier blob at ``upstream``, but for the events in ``replaced``; a line
    that is not a JSON object is kept as it is (the pusher judges it)."""
    if not upstream.exists():
        return []
    out = []
    for line in upstream.read_bytes().splitlines():
        try:
            uid = json.loads(line).get("event_uid")
        except (ValueError, AttributeError):
            uid = None
        if line.strip() and uid not in replaced:
            out.append(line + b"\n")
    return out


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
    birthright are never rewritten); an identical one is skipped. Each fragment's event is marked
    ``canon`` (composed: never in a logout blob again), in the same transaction as its merge, so a
    bad fragment changes nothing. Returns how many were new."""
    local = {e.event_uid: e for e in memory.entries()}
    known = set(local)
    added = 0
    for fragment in fragments:
        uid = fragment["event_uid"]
        try:
            with memory.primary:
                memory.primary.execute(
                    "INSERT OR REPLACE INTO sync_marks VALUES (?, 'canon', ?)", (uid, memory.clock())
                )
                if uid in known:
                    mine = local.get(uid)
                    if (
                        mine is None
                        or mine.text == fragment["text"]
                        or mine.memory_class not in ("working", "volatile")
                    ):
                        continue
                    memory.delete([uid])  # canon replaces it below, same event_uid
                    added -= 1  # a merge, not a new event
                fields = {k: v for k, v in fragment.items() if k in FRAGMENT_FIELDS}
                memory.write(
                    fragment["text"],
                    fragment["speaker"],
                    fragment["memory_class"],
                    fragment["data_category"],
                    event_uid=uid,
                    source_ids=tuple(fragment.get("source_ids", ())),
                    **fields,
                )
        except BaseException:
            memory._indexes.pop("primary", None)  # rolled back: reloaded from the store when next read
            raise
        known.add(uid)
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
