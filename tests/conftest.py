"""Shared fixtures: the shared literary corpus, one tiny end-to-end run, the Flower deployment.
Helpers (pipeline runners, loopback servers, stand-ins) live in tests/helpers/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import CORPUS
from tests.helpers.pipelines import run_pipeline
from tests.helpers.shared_job import SharedJob

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower may not call out of the machine
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"
if os.environ.get("PYTEST_XDIST_WORKER"):  # several workers share the cores: one thread each, and in
    for _threads in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # their subprocesses (OpenMP threads that
        os.environ.setdefault(_threads, "1")  # wait for a busy core spin, and slowed tests tenfold)

FLOWER_DEPLOY_TEST = Path(__file__).resolve().parent / "e2e" / "test_federation_deploy.py"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS.is_dir():
        pytest.fail(f"the shared literary corpus is missing at {CORPUS} (../shared/corpora/literary)")
    return CORPUS


HANG_GUARD_S = 40 * 60  # a shared job that has not ended by then hangs; never a speed bound


def _tiny_run(workdir: Path) -> Path:
    proc = run_pipeline("run_all", workdir, "experiment=ci_tiny")
    (workdir / "run_all.log").write_text(proc.stdout + proc.stderr)  # what the server side printed
    return workdir


def _flower_deployment(work: Path) -> dict:
    from tests.e2e.test_federation_deploy import journey

    return journey(work)


@pytest.fixture(scope="session", autouse=True)
def shared_jobs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The session's slow shared jobs (tests/helpers/shared_job.py), started in the background
    when the session begins, each only when a selected test needs it: the tiny end-to-end run and
    the Flower deployment (tests/e2e/test_federation_deploy.py). The suite goes on meanwhile."""
    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # shared by the workers
    jobs = {"tiny_run": SharedJob(root, "tiny_run", _tiny_run)}
    jobs["flower_deployment"] = SharedJob(root, "flower_deployment", _flower_deployment)
    items = request.session.items
    if CORPUS.is_dir() and any("tiny_run" in item.fixturenames for item in items):
        jobs["tiny_run"].start()  # (without the corpus, corpus_dir fails each test that needs it)
    if any(item.path.resolve() == FLOWER_DEPLOY_TEST for item in items):
        jobs["flower_deployment"].start()
    yield jobs
    for job in jobs.values():
        job.close(HANG_GUARD_S)


@pytest.fixture(scope="session")
def tiny_run(shared_jobs: dict[str, SharedJob], corpus_dir: Path) -> Path:
    """One `run_all experiment=ci_tiny` shared by the end-to-end tests; returns its workdir."""
    shared_jobs["tiny_run"].start()  # (already claimed when the session began)
    return shared_jobs["tiny_run"].outcome(HANG_GUARD_S)


@pytest.fixture(scope="session")
def flower_two_rounds(shared_jobs: dict[str, SharedJob]) -> dict:
    """The Flower deployment's outcome (tests/e2e/test_federation_deploy.py :func:`journey`)."""
    shared_jobs["flower_deployment"].start()
    return shared_jobs["flower_deployment"].outcome(HANG_GUARD_S)


def _scope(item: pytest.Item) -> str:
    """The item's xdist group: the tiny run's tests together; a test that shares a module (or
    class) fixture with its file's tests beside them (the fixture is built once); else alone."""
    if "tiny_run" in item.fixturenames:
        return "tiny_run"
    info = getattr(item, "_fixtureinfo", None)
    defs = [d for ds in (info.name2fixturedefs.values() if info else ()) for d in ds]
    shared = any(d.scope in ("module", "class", "package") for d in defs)
    return item.nodeid.split("::")[0] if shared else item.nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """pytest-xdist groups (``--dist loadgroup``, :func:`_scope`); every test of the tiny run runs
    in one worker, in order (some run stages in its workdir). The tests that wait for a shared
    job go last, so that the workers run the others while the jobs run in the background."""
    waits = {id(i) for i in items if "tiny_run" in i.fixturenames or i.path.resolve() == FLOWER_DEPLOY_TEST}
    items.sort(key=lambda item: id(item) in waits)  # stable: the order within each part stays
    for item in items:
        item.add_marker(pytest.mark.xdist_group(_scope(item)))
