"""Helpers for the tests (no tests here): loopback servers, tiny builders, stand-in embedders and
pipeline runners. :data:`REPO` is the one place tests learn where the repository is."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO.parent / "shared" / "corpora" / "literary"
