"""A slow job that one pytest process runs in the background for every process of the session:
the tiny end-to-end run and the Flower deployment (tests/conftest.py). With pytest-xdist the
workers share one folder; the first to claim the job runs it in a thread and writes its result
(or its error) there, atomically; a test in any worker waits for that file. Without xdist the
one process claims every job. The waits are hang guards, never bounds on how slow a machine is."""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Callable
from pathlib import Path
from traceback import format_exc
from typing import Any

POLL_S = 0.5


class SharedJob:
    """``job(work)`` run once per session, its outcome readable from every worker."""

    def __init__(self, root: Path, name: str, job: Callable[[Path], Any]) -> None:
        self.work, self.job = root / name, job
        self.claim, self.result = root / f"{name}.claimed", root / f"{name}.outcome.pickle"
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        """Run the job in a background thread unless another worker has claimed it."""
        try:
            fd = os.open(self.claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        with os.fdopen(fd, "w") as claim:
            claim.write(str(os.getpid()))  # waiters in other workers check that it still lives
        self.thread = threading.Thread(target=self._run, daemon=True, name=self.work.name)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.work.mkdir(parents=True)
            outcome: tuple[str, Any] = ("result", self.job(self.work))
        except BaseException:  # noqa: BLE001 - raised again in each test that reads it
            outcome = ("error", RuntimeError(f"the shared job {self.work.name} failed:\n{format_exc()}"))
        try:
            data = pickle.dumps(outcome)
        except Exception:  # noqa: BLE001 - an outcome that cannot travel: its error, as text, does
            why = f"the shared job {self.work.name}'s outcome does not pickle:\n{format_exc()}"
            data = pickle.dumps(("error", RuntimeError(why)))
        partial = self.result.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(self.result)

    def outcome(self, timeout: float) -> Any:
        """The job's result (its error raised here), waiting up to ``timeout`` s for it."""
        deadline = time.monotonic() + timeout
        while not self.result.exists():
            assert self.thread is None or self.thread.is_alive() or self.result.exists(), (
                f"the shared job {self.work.name} ended in this worker without an outcome"
            )
            assert self._claimer_alive() or self.result.exists(), (
                f"the worker running the shared job {self.work.name} died without an outcome"
            )
            assert time.monotonic() < deadline, (
                f"the shared job {self.work.name!r} still runs after {timeout} s"
            )
            time.sleep(POLL_S)
        kind, value = pickle.loads(self.result.read_bytes())
        if kind == "error":
            raise value
        return value

    def _claimer_alive(self) -> bool:
        """False once the process that claimed the job is gone (a worker killed mid-job)."""
        try:
            pid = int(self.claim.read_text() or "0")
        except (OSError, ValueError):
            return True  # not claimed yet, or the claim is being written
        if not pid:
            return True
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def close(self, timeout: float) -> None:
        """At the end of this worker's session: let a job it runs finish (others may need it)."""
        if self.thread is not None:
            self.thread.join(timeout)
