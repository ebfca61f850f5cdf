"""Shared fixtures: the shared literary corpus, one tiny end-to-end run, the Flower deployment.
Helpers (pipeline runners, loopback servers, stand-ins) live in tests/helpers/."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import CORPUS
from tests.helpers.pipelines import run_pipeline

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"  # Flower may not call out of the machine
os.environ["FLWR_DISABLE_UPDATE_CHECK"] = "1"

FLOWER_DEPLOY_TEST = Path(__file__).resolve().parent / "e2e" / "test_federation_deploy.py"


@pytest.fixture(scope="session")
def corpus_dir() -> Path:
    if not CORPUS.is_dir():
        pytest.fail(f"the shared literary corpus is missing at {CORPUS} (../shared/corpora/literary)")
    return CORPUS


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path) -> Path:
    """One `run_all experiment=ci_tiny` shared by the end-to-end tests; returns its workdir. Its
    timeout is run_pipeline's hang guard (30 min), never a bound on how slow the machine may be."""
    workdir = tmp_path_factory.mktemp("tiny_run")
    proc = run_pipeline("run_all", workdir, "experiment=ci_tiny")
    (workdir / "run_all.log").write_text(proc.stdout + proc.stderr)  # what the server side printed
    return workdir


@pytest.fixture(scope="session", autouse=True)
def flower_two_rounds(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    """The Flower deployment run (tests/e2e/test_federation_deploy.py), started in the background
    when the session begins, when that test is selected; the test joins it."""
    if not any(item.path.resolve() == FLOWER_DEPLOY_TEST for item in request.session.items):
        yield None
        return
    from tests.e2e.test_federation_deploy import start

    job = start(tmp_path_factory.mktemp("flower_deployment"))
    yield job
    job.join(timeout=60)
