"""The server says why it waits (issue 42): with fewer than ``min-participants`` nodes online a
round samples nobody, and the server used to sit silently at "Secure aggregation commencing".
Now it logs "waiting for N nodes, M online" when the wait starts and periodically, and once when
the round goes ahead. The real round loop (``rounds.serve``, SecAgg+, the project's client mods)
over an in-process grid whose second node connects only after a while."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.client import ClientApp, NumPyClient

from nimmer_train.config.federated import FederatedConfig, UserDPConfig
from nimmer_train.federation import rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.wire import A1_UPDATE
from tests.helpers.loopback_grid import LoopbackGrid

SETTINGS = FederatedConfig(
    rounds=1, min_participants=2, heldout_examples=4, user_dp=UserDPConfig(population_size=2)
)


class _Trainer(NumPyClient):
    """A device whose training moved the adapter a little (a real A.1 update)."""

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple:
        return [p + np.float32(1e-4) for p in parameters], 1, {A1_UPDATE: True}


class LateGrid(LoopbackGrid):
    """The second node connects to the SuperLink only after the server has looked ``late`` times."""

    def __init__(self, apps: dict[int, ClientApp], late: int) -> None:
        super().__init__(apps)
        self.looks, self.late = 0, late

    def get_node_ids(self) -> list[int]:
        self.looks += 1
        ids = list(self.apps)
        return ids if self.looks > self.late else ids[:1]


@pytest.mark.usefixtures("quiet")
def test_the_server_says_it_waits_for_nodes_and_when_the_round_goes_ahead(
    release: tuple[Path, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(rounds, "NODE_POLL_S", 0.01)  # count the nodes often,
    monkeypatch.setattr(rounds, "NODE_WAIT_NOTE_S", 0.0)  # and say so each time (10 s in production)
    app = ClientApp(
        client_fn=lambda _ctx: _Trainer().to_client(), mods=list(client_app(lambda _c: None)._mods)
    )
    grid = LateGrid({101: app, 102: app}, late=5)
    setup = rounds.make_setup(*release, tmp_path, SETTINGS, None)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.INFO, logger="nimmer_train.federation.rounds"), grid.serving():
        state = rounds.serve(grid, context, SETTINGS, setup, lambda _record: None)
    lines = [r.getMessage() for r in caplog.records if r.name == "nimmer_train.federation.rounds"]
    waiting = [line for line in lines if line.startswith("round 1: waiting for 2 nodes, 1 online")]
    going = [i for i, line in enumerate(lines) if line.startswith("round 1: 2 nodes online after")]
    assert len(waiting) >= 2 and "min-participants=2" in waiting[0]  # when it starts, then periodically
    assert len(going) == 1 and going[0] > lines.index(waiting[-1])  # once, when it goes ahead
    assert state.records[-1]["accepted"]  # and the round ran with both nodes


@pytest.mark.usefixtures("quiet")
def test_the_server_says_nothing_of_waiting_when_enough_nodes_are_online(
    release: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    app = ClientApp(
        client_fn=lambda _ctx: _Trainer().to_client(), mods=list(client_app(lambda _c: None)._mods)
    )
    setup = rounds.make_setup(*release, tmp_path, SETTINGS, None)
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    grid = LoopbackGrid({101: app, 102: app})
    with caplog.at_level(logging.INFO, logger="nimmer_train.federation.rounds"), grid.serving():
        rounds.serve(grid, context, SETTINGS, setup, lambda _record: None)
    assert not any("waiting for" in r.getMessage() for r in caplog.records)
