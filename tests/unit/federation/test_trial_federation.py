"""The documented trial run works with two devices (issue 42): the run config that
docs/federation-deployment.md gives under "A trial run with two devices", read from the page and
parsed as `flwr run --run-config` parses it, runs through the server's round loop
(``rounds.serve``: SecAgg+ with its threshold of 2 of 2 shares, NoisyMean, the ledger) against two
real contributors' devices (the project's ClientApp and mod chain, Opacus training) over an
in-process grid (tests/helpers/loopback_grid.py: Flower's code throughout, no transport).

Both rounds are released; each device's log keys them by the federation's id and, once the
server has told its outcome, says released rather than "if this round is released"; a second
federation on the same SuperLink address (a new work-dir, so a new ledger) is kept apart, and the
device's total adds both."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from flwr.app import Context, RecordDict
from flwr.common.config import parse_config_args

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation import rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.client import Node
from nimmer_train.memory.consent import grant
from nimmer_train.memory.contributions import entries, render, spend
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from tests.helpers import REPO
from tests.helpers.loopback_grid import LoopbackGrid
from tests.helpers.memory import HashEmbedder

ADDRESS = "127.0.0.1:8000"  # what `nimmer contribute` passes as the federation's name
QUICK = {"local.steps": 1, "local.batch-size": 4, "heldout-examples": 4}


def documented_trial() -> dict[str, Any]:
    """The trial run config as the docs give it (the places are replaced by the test's)."""
    page = (REPO / "docs" / "federation-deployment.md").read_text()
    section = page.split("**A trial run with two devices.**", 1)[1]
    (quoted,) = re.findall(r"--run-config '([^']*)'", section.split("```", 2)[1])
    return parse_config_args([quoted])


def _devices(work: Path) -> list[Path]:
    folders = []
    for i in range(2):
        folder = work / f"player{i}"
        generate_player(folder, HashEmbedder(), seed=20 + i, entries=40, player_id=f"player-{i}a7")
        memory = PlayerMemory(folder, HashEmbedder())
        try:
            grant(memory, "A1_federated")
        finally:
            memory.close()
        folders.append(folder)
    return folders


def _federation(
    release: tuple[Path, Path], devices: list[Path], run_config: dict[str, Any], work: Path
) -> Any:
    """One deployed federation's rounds (the ServerApp's ``serve``) over two device nodes."""
    settings = FederatedConfig.from_run_config(run_config)
    setup = rounds.make_setup(*release, work, settings, None)

    def node_of(context: Context) -> Node:
        return Node(*release, device=devices[context.node_id - 101], federation=ADDRESS)

    app = client_app(node_of)
    grid = LoopbackGrid({101: app, 102: app})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with grid.serving():
        return rounds.serve(grid, context, settings, setup, lambda _record: None)


@pytest.mark.usefixtures("quiet")
def test_the_documented_two_device_trial_releases_its_rounds_and_devices_see_it(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    trial = documented_trial()
    assert trial["min-participants"] == 2 and trial["user-dp.population-size"] == 2
    places = {k: v for k, v in trial.items() if k.endswith("-dir")}
    assert set(places) == {"base-dir", "adapter-dir", "work-dir", "out-dir"}
    # as documented, with the local recipe and the held-out set cut short (the round's mechanism,
    # SecAgg+'s shares and the release threshold are what the trial is about)
    assert str(trial["tracking-uri"]).startswith("sqlite:")  # the MLflow run (not this test's business)
    run_config = {k: v for k, v in trial.items() if k not in places and k != "tracking-uri"} | QUICK
    devices = _devices(tmp_path)
    state = _federation(release, devices, run_config, tmp_path / "rounds")
    assert [(r["round"], r["accepted"]) for r in state.records] == [(1, True), (2, True)]
    assert state.records[-1]["participants"] == 2 and state.stopped == "completed"
    first = rounds.federation_id(tmp_path / "rounds")
    for device in devices:
        log = entries(device)
        trained = [e for e in log if e["kind"] == "round"]
        assert [(e["round"], e["federation_id"]) for e in trained] == [(1, first), (2, first)]
        (told,) = [e for e in log if e["kind"] == "outcome"]
        assert told["final"] and told["not_released"] == [] and told["rounds_done"] == 2
        assert told["epsilon"] == pytest.approx(state.records[-1]["epsilon_a1_user_level"])
        assert not any("if this round is released" in line for line in render(log))
    # a second federation on the same address: a new ledger, kept apart; the total adds both
    state2 = _federation(release, devices, {**run_config, "rounds": 1}, tmp_path / "rounds2")
    second = rounds.federation_id(tmp_path / "rounds2")
    assert second != first and state2.records[-1]["accepted"]
    by = spend(devices[0])
    assert set(by) == {first, second}
    assert by[first]["rounds"] == 2 and by[first]["released"] == 2 and by[second]["rounds"] == 1
    assert by[first]["epsilon"] == pytest.approx(state.records[-1]["epsilon_a1_user_level"])
    assert by[second]["epsilon"] == pytest.approx(state2.records[-1]["epsilon_a1_user_level"])
    assert all(f["federation"] == ADDRESS for f in by.values())
