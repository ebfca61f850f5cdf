"""The consolidation schedule: every 30 minutes of (game) time, one run at a time, missed runs
coalesced into one.

Two guards make "one at a time" hold across threads and processes: APScheduler's
``max_instances=1`` (and ``coalesce=True``) for the in-process job, and an exclusive,
non-blocking ``flock`` on ``consolidation.lock`` in the agent folder, so the CLI's on-demand
``nimmer memory consolidate`` and a running server never consolidate the same folder at once
(the second one is told, and skips). The job wakes every ``tick_s`` real seconds and runs when
``interval_s`` of the agent's clock has passed since the last run, so a game clock that jumps
ahead by five intervals gets one run, not five.
"""

from __future__ import annotations

import fcntl
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from nimmer_train.agent.consolidation import DEFAULT_POLICY, ConsolidationPolicy, consolidate
from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.extra import missing_extra
from nimmer_train.memory.db import get_meta

LOCK_FILE = "consolidation.lock"


@contextmanager
def consolidation_lock(folder: Path) -> Iterator[bool]:
    """Yields True when this caller holds the folder's consolidation lock, False if another does."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def run_once(
    agent: CrystalStore, now: float | None = None, policy: ConsolidationPolicy = DEFAULT_POLICY
) -> dict[str, object] | None:
    """Consolidate now unless another run holds the lock (then None)."""
    with consolidation_lock(agent.folder) as held:
        if not held:
            return None
        return consolidate(agent, now, policy)


def due(agent: CrystalStore, now: float, interval_s: float) -> bool:
    last = get_meta(agent.db("primary"), "last_consolidation")
    return last is None or now - float(last) >= interval_s  # type: ignore[arg-type]


class ConsolidationScheduler:
    """APScheduler (3.x) BackgroundScheduler with one coalesced, single-instance job."""

    def __init__(
        self, agent: CrystalStore, policy: ConsolidationPolicy = DEFAULT_POLICY, tick_s: float = 60.0
    ) -> None:
        try:  # the agent extra (extra.py): only a standing server schedules consolidation
            from apscheduler.schedulers.background import BackgroundScheduler
        except ImportError as exc:
            raise missing_extra("apscheduler", "the consolidation schedule") from exc

        self.agent, self.policy, self.tick_s = agent, policy, tick_s
        self.runs = 0
        self.skipped = 0
        self.last_wall_s: float | None = None
        self._busy = threading.Lock()
        self.scheduler = BackgroundScheduler()
        self.job = self.scheduler.add_job(
            self.tick,
            "interval",
            seconds=tick_s,
            id="memory-consolidation",
            coalesce=True,
            max_instances=1,
            misfire_grace_time=None,
        )
        agent.scheduler_info = self.info

    def tick(self) -> dict[str, object] | None:
        """Run consolidation if due by the agent's clock (the scheduled job; callable directly)."""
        now = self.agent.clock()
        if not due(self.agent, now, self.policy.interval_s):
            return None
        if not self._busy.acquire(blocking=False):
            self.skipped += 1
            return None
        try:
            report = run_once(self.agent, now, self.policy)
            if report is None:
                self.skipped += 1
                return None
            self.runs += 1
            self.last_wall_s = float(report["wall_s"])  # type: ignore[arg-type]
            return report
        finally:
            self._busy.release()

    def info(self) -> dict[str, object]:
        return {
            "interval_s": self.policy.interval_s,
            "tick_s": self.tick_s,
            "runs": self.runs,
            "skipped_busy": self.skipped,
            "last_wall_s": self.last_wall_s,
            "max_instances": 1,
            "coalesce": True,
        }

    def start(self) -> ConsolidationScheduler:
        self.scheduler.start()
        return self

    def shutdown(self) -> None:
        self.scheduler.shutdown(wait=True)
