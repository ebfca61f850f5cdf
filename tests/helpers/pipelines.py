"""Run ``python -m pipelines.<name>`` as a user would, and kill one midway.

Timeouts here guard against hangs, never against slowness: a whole pipeline on a loaded two-core
machine may take many minutes, so each bound is a generous hang guard.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers import REPO

PIPELINE_TIMEOUT_S = 30 * 60  # a hang guard for one whole pipeline run (run_all included)


def run_pipeline(
    name: str, workdir: Path, *overrides: str, check: bool = True, timeout: float = PIPELINE_TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pipelines.<name>`` with its outputs under ``workdir``."""
    cmd = [sys.executable, "-m", f"pipelines.{name}", f"paths.workdir={workdir}", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def kill_when(
    name: str,
    workdir: Path,
    *overrides: str,
    ready: Callable[[], bool],
    timeout: float = PIPELINE_TIMEOUT_S,
) -> None:
    """Start ``pipelines.<name>`` and SIGKILL it, with every process it started (its session), the
    moment ``ready()`` holds (it must still run). ``timeout`` bounds the wait for ``ready()``: the
    pipeline's real work up to that point, so it is a hang guard as generous as a whole run's."""
    cmd = [sys.executable, "-m", f"pipelines.{name}", f"paths.workdir={workdir}", *overrides]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    try:
        while not ready():
            assert proc.poll() is None, f"{name} finished before it could be killed"
            assert time.monotonic() < deadline, f"{name}: not ready to be killed after {timeout} s"
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
