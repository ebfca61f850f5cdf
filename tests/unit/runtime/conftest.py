"""A signed version with three register LoRAs, published here in seconds (tests/helpers/published.py),
shared by the engine and server tests of this folder."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.openai_server import create_app
from tests.helpers.loopback import serve_app
from tests.helpers.published import publish_registers


@pytest.fixture(scope="session")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return publish_registers(tmp_path_factory.mktemp("published"))


# one model and one loopback server per test module over that version (engine tests and attacks)
@pytest.fixture(scope="module")
def model(published: tuple[Path, Path]) -> Iterator[LocalModel]:
    releases, trusted = published
    m = LocalModel.open(releases, "v1", trusted)
    yield m
    m.close()


@pytest.fixture(scope="module")
def url(model: LocalModel) -> Iterator[str]:
    with serve_app(create_app(model, adapter_updates=True)) as base:
        yield base
