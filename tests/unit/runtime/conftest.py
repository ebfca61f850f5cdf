"""A signed version with three register LoRAs, published here in seconds (tests/helpers/published.py),
shared by the engine and server tests of this folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.published import publish_registers


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return publish_registers(tmp_path_factory.mktemp("published"))
