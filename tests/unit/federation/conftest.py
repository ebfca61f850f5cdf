"""Fixtures shared by this folder's tests."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers.flower_deployment import tiny_release


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base folder, adapter folder) of a tiny release, one per test module
    (test_contributor.py's is a signed release with a register LoRA instead)."""
    base, adapter, _ = tiny_release(tmp_path_factory.mktemp("release"))
    return base, adapter


@pytest.fixture
def quiet() -> Iterator[None]:
    """Flower's log at ERROR and warnings ignored for one test that drives Flower's strategy or
    Opacus directly (their notes are noise there); Flower's level is restored after it, since
    other tests read the federation's log lines."""
    logger = logging.getLogger("flwr")
    level = logger.level
    logger.setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    yield
    logger.setLevel(level)
