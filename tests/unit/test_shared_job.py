"""The test harness's shared background jobs (tests/helpers/shared_job.py): one worker runs the
job, every other reads its outcome, and a waiter learns at once when the runner died."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.shared_job import SharedJob


def test_another_worker_reads_the_outcome_of_the_job_one_worker_ran(tmp_path: Path) -> None:
    runner = SharedJob(tmp_path, "job", lambda work: (work.name, 42))
    runner.start()
    other = SharedJob(tmp_path, "job", lambda work: pytest.fail("claimed twice"))
    other.start()  # already claimed: runs nothing
    assert other.outcome(timeout=60) == ("job", 42) and runner.outcome(timeout=60) == ("job", 42)


def test_a_job_that_raises_fails_each_waiter_with_its_traceback(tmp_path: Path) -> None:
    def broken(work: Path) -> None:
        raise ValueError("no corpus")

    runner = SharedJob(tmp_path, "job", broken)
    runner.start()
    with pytest.raises(RuntimeError, match="no corpus"):
        SharedJob(tmp_path, "job", broken).outcome(timeout=60)


def test_a_waiter_fails_at_once_when_the_worker_that_claimed_the_job_died(tmp_path: Path) -> None:
    """Before: the other workers polled until the 40-minute hang guard."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    (tmp_path / "job.claimed").write_text(gone.stdout.decode().strip())
    started = time.monotonic()
    with pytest.raises(AssertionError, match="died without an outcome"):
        SharedJob(tmp_path, "job", lambda work: None).outcome(timeout=2400)
    assert time.monotonic() - started < 60
