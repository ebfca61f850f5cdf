"""Only the server's own A.2 node can make it account an A.2 step. SuperNodes are not
authenticated, and the server accepted the configured A.2 step from any node that claimed it: a
plain A.1 device sending the three A.2 metrics was accounted as an A.2 DP-SGD run (a higher
published A.2 epsilon, a budget spent sooner; an over-count, never an under-count). The A.2 node
now tags its claim with the pool's claim key, for the round and the server's nonce; the server
accounts a claim only with a valid tag and ignores any other with one warning line.

The rounds run the real server loop (``rounds.serve``: NoisyMean, the SecAgg+ workflow, the
ledger) against ClientApps with Flower's ``secaggplus_mod`` and the project's client mods
(``app.client_app``'s chain), over an in-process grid (tests/helpers/loopback_grid.py: Flower's
code throughout, no transport). The A.2 node is the real one (``client.Contributor`` on a pool)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.client import ClientApp, NumPyClient

from nimmer_train.config.federated import FederatedConfig, LocalRecipeConfig, SimulationConfig, UserDPConfig
from nimmer_train.errors import NimmerError
from nimmer_train.federation import budget, rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.client import Contributor, Node
from nimmer_train.federation.wire import A1_UPDATE, A2_KEY_ID, A2_METRICS, A2_NONCE, a2_key_id, get_arrays
from nimmer_train.privacy.a2_pool import A2Pool, claim_key
from nimmer_train.privacy.anonymize import anonymize
from tests.helpers.loopback_grid import LoopbackGrid

NODES = 5  # four A.1 devices and, where a test has one, the A.2 node
SETTINGS = FederatedConfig(
    rounds=1,
    min_participants=3,
    heldout_examples=4,
    local=LocalRecipeConfig(steps=2, max_length=24),
    user_dp=UserDPConfig(fraction_fit=1.0, noise_multiplier=1e-3),
    simulation=SimulationConfig(contributors=NODES - 1),  # N = 5 nodes, all sampled
)
CLAIM_LOG = "A.2 accounting claim without a valid tag"
Metrics = Callable[[int], dict[str, Any]]


class _Device(NumPyClient):
    """An A.1 device: a real A.1 update, plus whatever ``extra`` metrics it chooses to send in
    the round (SuperNodes are not authenticated: a node runs what it likes)."""

    def __init__(self, extra: Metrics) -> None:
        self.extra = extra

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple:
        moved = [p + np.float32(1e-3) for p in parameters]
        return moved, 1, {A1_UPDATE: True, **self.extra(int(config["round"]))}


def _app(client: Callable[[], NumPyClient]) -> ClientApp:
    return ClientApp(
        client_fn=lambda _ctx: client().to_client(), mods=list(client_app(lambda _c: None)._mods)
    )


def _pool(folder: Path) -> Path:
    """An A.2 intake of two uploads (k = 2)."""
    path = folder / "server" / "a2_pool.sqlite"
    pool = A2Pool(path, 2)
    for i in range(2):
        rows = [
            {
                "speaker": "npc:oran",
                "text": f"the ferry bell rang {i} times",
                "data_category": "casual_dialog",
            }
        ]
        pool.add(anonymize(rows, f"player-{i}", f"Name{i}"))
    pool.close()
    return path


def _serve(
    release: tuple[Path, Path],
    work: Path,
    devices: list[Metrics],
    pool: Path | None,
    a2_node: bool,
    settings: FederatedConfig = SETTINGS,
    grids: list[LoopbackGrid] | None = None,
) -> tuple[dict, list[tuple]]:
    """Serve ``settings.rounds`` rounds to A.1 devices sending ``devices``' extra metrics (and the
    real A.2 node on ``pool`` when ``a2_node``), the server knowing ``pool``: the last round's
    record and the A.2 ledger's round steps (the pool counts' release left out); the grid goes
    into ``grids`` before the first round."""
    setup = rounds.make_setup(*release, work, settings, pool)
    apps = {101 + i: _app(lambda e=extra: _Device(e)) for i, extra in enumerate(devices)}
    if a2_node:
        assert pool is not None
        apps[101 + len(devices)] = _app(lambda: Contributor(Node(*release, a2_pool=pool)))
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    grid = LoopbackGrid(apps)
    (grids if grids is not None else []).append(grid)
    with grid.serving():
        state = rounds.serve(grid, context, settings, setup, lambda _record: None)
    counts = budget.count_step(settings)
    steps = [tuple(s) for s in state.ledger["a2"] if tuple(s) != counts]
    return state.records[-1], steps


def _nothing(_round: int) -> dict[str, Any]:
    return {}


def _a2_step(_round: int) -> dict[str, Any]:
    """What a device needs to send to claim the configured A.2 step (the settings are public)."""
    return dict(zip(A2_METRICS, budget.planned_a2(SETTINGS), strict=True))


@pytest.mark.usefixtures("quiet")
def test_a_device_claiming_the_a2_step_is_not_accounted(
    release: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Four A.1 devices, one of them claiming the configured A.2 step, on a server with a pool
    but no A.2 node in the round: before, the claim reached the ledger as an A.2 DP-SGD run.
    Now the round is released with no A.2 step, and one line says a claim was ignored."""
    with caplog.at_level(logging.WARNING, logger="nimmer_train.federation.strategy"):
        record, steps = _serve(
            release, tmp_path, [_nothing, _nothing, _nothing, _a2_step], _pool(tmp_path), a2_node=False
        )
    assert record["accepted"], record["reason"]
    assert steps == []
    lines = [r.getMessage() for r in caplog.records if CLAIM_LOG in r.getMessage()]
    assert len(lines) == 1 and "round 1" in lines[0]


@pytest.mark.usefixtures("quiet")
def test_a_server_without_a_pool_accounts_no_a2_claim(release: tuple[Path, Path], tmp_path: Path) -> None:
    """No pool, no claim key: nothing any node says is accounted as A.2 training."""
    record, steps = _serve(release, tmp_path, [_nothing, _nothing, _nothing, _a2_step], None, a2_node=False)
    assert record["accepted"], record["reason"]
    assert steps == []


@pytest.fixture(scope="module")
def replayed(release: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two rounds with the real A.2 node; in round 2 one device sends, word for word, the claim
    (step and tag) the A.2 node sent in round 1, as if it had seen it."""
    work = tmp_path_factory.mktemp("replay")
    grids: list[LoopbackGrid] = []  # the grid, once built: the replayer reads round 1's replies there

    def replay(server_round: int) -> dict[str, Any]:
        if server_round < 2:
            return {}
        sent = [r.content.config_records.get("fitres.metrics") for r in grids[0].replies if not r.has_error()]
        claims = [dict(m) for m in sent if m is not None and A2_METRICS[0] in m]
        assert len(claims) == 1, "round 1 holds exactly the A.2 node's claim"
        return claims[0]

    devices = [_nothing, _nothing, _nothing, replay]
    settings = dataclasses.replace(SETTINGS, rounds=2)
    record, steps = _serve(release, work, devices, _pool(work), a2_node=True, settings=settings, grids=grids)
    return {"record": record, "steps": steps}


def test_the_pools_a2_node_has_its_step_accounted(replayed: dict[str, Any]) -> None:
    """The control: the real A.2 node's tagged claim counts, once in each of the two rounds."""
    assert replayed["record"]["accepted"], replayed["record"]["reason"]
    assert replayed["steps"] == [budget.planned_a2(SETTINGS)] * 2


def test_a_claim_replayed_from_another_round_is_not_accounted(replayed: dict[str, Any]) -> None:
    """Round 2 held the A.2 node's fresh claim and a device's copy of its round-1 claim (tag
    included): before, both were accounted (three A.2 runs over two rounds); now only the A.2
    node's own (two)."""
    assert len(replayed["steps"]) == 2


def test_an_a2_node_whose_pool_the_server_does_not_check_trains_nothing(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """No claim key beside the pool (no server was started with it), or a server that checks
    claims with no key or another one: the A.2 node refuses to train, naming the file or the
    pool, rather than add an update the server does not account."""
    pool = _pool(tmp_path)
    model = rounds.make_setup(*release, tmp_path / "work", SETTINGS, None).model
    config = {**rounds.fit_config(SETTINGS, rounds.spec_of(model)), "round": 1}
    node = Contributor(Node(*release, a2_pool=pool))
    with pytest.raises(NimmerError, match="claim-key"):
        node.fit(get_arrays(model), config)
    claim_key(pool, create=True)
    for other in ({}, {A2_NONCE: "n", A2_KEY_ID: a2_key_id(b"1" * 64)}):
        with pytest.raises(NimmerError, match="does not account the A.2 pool"):
            node.fit(get_arrays(model), {**config, **other})
