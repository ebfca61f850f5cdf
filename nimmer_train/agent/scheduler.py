"""The memory's own schedule: consolidation every 30 minutes of (game) time, one run at a time,
missed runs coalesced into one; and, on every tick, the dream engine's tick (its gate decides
whether a cycle or a mini-dream runs), so a standing agent dreams without anyone asking. Its four
LLM modes run with the teacher backend the engine was given, and are reported skipped ("no
teacher") without one (memory_status' ``scheduler.dreams`` says which).

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
from nimmer_train.agent.dreams import DreamEngine
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
    """APScheduler (3.x) BackgroundScheduler with one coalesced, single-instance job that
    consolidates when due and ticks ``dreams`` (a :class:`DreamEngine`; None: no dreams)."""

    def __init__(
        self,
        agent: CrystalStore,
        policy: ConsolidationPolicy = DEFAULT_POLICY,
        tick_s: float = 60.0,
        dreams: DreamEngine | None = None,
    ) -> None:
        try:  # the agent extra (extra.py): only a standing server schedules consolidation
            from apscheduler.schedulers.background import BackgroundScheduler
        except ImportError as exc:
            raise missing_extra("apscheduler", "the consolidation schedule") from exc

        self.agent, self.policy, self.tick_s, self.dreams = agent, policy, tick_s, dreams
        self.dream_ticks, self.dream_runs, self.dream_skipped = 0, {"cycle": 0, "mini": 0}, 0
        self.last_dream: dict[str, object] | None = None
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
        """Consolidate if due by the agent's clock, then tick the dream engine (the scheduled
        job; callable directly). Returns the consolidation report, None when none ran."""
        now = self.agent.clock()
        report = self._consolidate(now)
        self._dream(now)
        return report

    def _consolidate(self, now: float) -> dict[str, object] | None:
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

    def _dream(self, now: float) -> None:
        """One dream tick under the same locks as consolidation (one memory job per folder)."""
        if self.dreams is None:
            return
        if not self._busy.acquire(blocking=False):
            self.dream_skipped += 1
            return
        try:
            with consolidation_lock(self.agent.folder) as held:
                if not held:
                    self.dream_skipped += 1
                    return
                result = self.dreams.tick(now)
            self.dream_ticks += 1
            if result.get("ran") in self.dream_runs:
                self.dream_runs[result["ran"]] += 1
                self.last_dream = {"at": now, **_summary(result)}
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
            "dreams": None
            if self.dreams is None
            else {
                "ticks": self.dream_ticks,
                "cycles": self.dream_runs["cycle"],
                "mini_dreams": self.dream_runs["mini"],
                "skipped_busy": self.dream_skipped,
                "llm_modes": "teacher configured"
                if self.dreams.teacher is not None
                else "skipped: no teacher",
                "last": self.last_dream,
            },
        }

    def start(self) -> ConsolidationScheduler:
        self.scheduler.start()
        return self

    def shutdown(self) -> None:
        self.scheduler.shutdown(wait=True)


def _summary(result: dict[str, object]) -> dict[str, object]:
    """What memory_status shows of a dream tick: what ran, its modes and each mode's outcome."""
    results = result.get("results") or ({result["mode"]: result} if "mode" in result else {})
    return {
        "ran": result.get("ran"),
        "reason": result.get("reason"),
        "modes": {
            m: {k: v for k, v in r.items() if k in ("insights", "skipped", "calls", "error")}
            for m, r in results.items()  # type: ignore[union-attr]
        },
    }
