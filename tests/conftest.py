"""Shared test helpers: the shared literary corpus, running pipelines as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO.parent / "shared" / "corpora" / "literary"

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower may not call out of the machine
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS.is_dir():
        pytest.fail(f"the shared literary corpus is missing at {CORPUS} (../shared/corpora/literary)")
    return CORPUS


def run_pipeline(
    name: str, workdir: Path, *overrides: str, check: bool = True, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m pipelines.<name>`` with its outputs under ``workdir``."""
    cmd = [sys.executable, "-m", f"pipelines.{name}", f"paths.workdir={workdir}", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    """One `run_all experiment=ci_tiny` shared by the end-to-end tests; returns its workdir."""
    workdir = tmp_path_factory.mktemp("tiny_run")
    proc = run_pipeline("run_all", workdir, "experiment=ci_tiny")
    (workdir / "run_all.log").write_text(proc.stdout + proc.stderr)  # what the server side printed
    return workdir


def kill_when(
    name: str, workdir: Path, *overrides: str, ready: Callable[[], bool], timeout: float = 240
) -> None:
    """Start ``pipelines.<name>`` and SIGKILL it, with every process it started (its session), the
    moment ``ready()`` holds (it must still run)."""
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


@pytest.fixture(scope="session", autouse=True)
def flower_two_rounds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The Flower deployment run (tests/test_federation_deploy.py), started in the background when
    the session begins, when that test is selected; the test joins it."""
    if not any(item.nodeid.startswith("tests/test_federation_deploy.py") for item in request.session.items):
        yield None
        return
    from tests.test_federation_deploy import start

    job = start(tmp_path_factory.mktemp("flower_deployment"))
    yield job
    job.join(timeout=60)
