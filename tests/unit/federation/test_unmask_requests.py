"""A device refuses a SecAgg+ unmask request that would let the server read one update alone.

In the unmask stage the server lists, per device, which of its neighbours are active (it asks
for the shares of their mask seeds) and which dropped (the shares of their masking keys).
Flower 1.42's client answers whatever it is asked: a node listed as both gives the server both
secrets, and with a threshold of shares of each it strips that node's masks from its masked
vector and reads its update (with local DP off, the raw update). The project's client refuses
such a request (``mods.unmask_guard_mod``) and releases no share; an honest request passes.

The rounds run the real server loop (``rounds.serve``) against ClientApps with the project's mod
chain (``app.client_app``'s) over an in-process grid (tests/helpers/loopback_grid.py); the attack
is a grid that edits the unmask requests and then does what a server can do with the replies."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.ndarrays_arithmetic import (
    factor_extract,
    get_parameters_shape,
    parameters_addition,
    parameters_mod,
    parameters_subtraction,
)
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from nimmer_train.config.federated import (
    SECAGG_MODULUS_RANGE,
    SECAGG_QUANTIZATION_RANGE,
    FederatedConfig,
    SimulationConfig,
    UserDPConfig,
)
from nimmer_train.federation import rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.mods import unmask_guard_mod, unmask_problem
from nimmer_train.federation.wire import A1_UPDATE, get_arrays, indicator_value
from tests.helpers.loopback_grid import LoopbackGrid

NODES, TARGET = 4, 101
SETTINGS = FederatedConfig(
    rounds=1,
    min_participants=2,
    heldout_examples=4,
    user_dp=UserDPConfig(fraction_fit=1.0),
    simulation=SimulationConfig(contributors=NODES - 1),  # N = 4 nodes, all sampled
)


class _Trainer(NumPyClient):
    def __init__(self, delta: list[np.ndarray]) -> None:
        self.delta = delta

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple:
        return [p + d for p, d in zip(parameters, self.delta, strict=True)], 1, {A1_UPDATE: True}


def _app(delta: list[np.ndarray], guarded: bool) -> ClientApp:
    """A node with the project's mod chain (``guarded=False``: the guard taken out of it, which
    leaves Flower's client as it answers on its own)."""
    mods = client_app(lambda _ctx: None)._mods
    if not guarded:
        mods = [m for m in mods if m is not unmask_guard_mod]
    return ClientApp(client_fn=lambda _ctx: _Trainer(delta).to_client(), mods=mods)


class _Unmasker(LoopbackGrid):
    """A server that lists TARGET as dropped too in every unmask request, and keeps what it needs
    to unmask TARGET alone: the public keys, TARGET's masked vector and every share of it."""

    def __init__(self, apps: dict[int, ClientApp]) -> None:
        super().__init__(apps)
        self.public_keys: dict[int, bytes] = {}
        self.masked: list[bytes] = []
        self.seed_shares: list[bytes] = []
        self.key_shares: list[bytes] = []
        self.threshold = 0

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        messages = list(messages)
        stage = messages[0].content.config_records[RECORD_KEY_CONFIGS][Key.STAGE] if messages else None
        for msg in messages:
            configs = msg.content.config_records[RECORD_KEY_CONFIGS]
            if stage == Stage.SETUP:
                self.threshold = int(configs[Key.THRESHOLD])
            if stage == Stage.UNMASK:
                configs[Key.DEAD_NODE_ID_LIST] = [*configs[Key.DEAD_NODE_ID_LIST], TARGET]
        replies = super().send_and_receive(messages, timeout=timeout)
        for reply in replies:
            if not reply.has_error():
                self._keep(
                    stage, reply.metadata.src_node_id, reply.content.config_records[RECORD_KEY_CONFIGS]
                )
        return replies

    def _keep(self, stage: Any, node: int, configs: Any) -> None:
        if stage == Stage.SETUP:
            self.public_keys[node] = configs[Key.PUBLIC_KEY_1]
        elif stage == Stage.COLLECT_MASKED_VECTORS and node == TARGET:
            self.masked = list(configs[Key.MASKED_PARAMETERS])
        elif stage == Stage.UNMASK:  # the node ids are the active list, then the dropped one
            owners, shares = list(configs[Key.NODE_ID_LIST]), list(configs[Key.SHARE_LIST])
            mine = [i for i, owner in enumerate(owners) if owner == TARGET]
            if len(mine) == 2:  # TARGET's mask seed share, then its masking key share
                self.seed_shares.append(shares[mine[0]])
                self.key_shares.append(shares[mine[1]])
                # the round goes on as if nothing happened: Flower's unmasking gets the seed share
                configs[Key.NODE_ID_LIST] = owners[: mine[1]] + owners[mine[1] + 1 :]
                configs[Key.SHARE_LIST] = shares[: mine[1]] + shares[mine[1] + 1 :]

    def unmasked(self) -> np.ndarray | None:
        """TARGET's contribution, read alone (None without a threshold of shares of both)."""
        if min(len(self.seed_shares), len(self.key_shares)) < self.threshold or not self.masked:
            return None
        seed, key = combine_shares(self.seed_shares), combine_shares(self.key_shares)
        vector = [bytes_to_ndarray(b) for b in self.masked]
        shapes = get_parameters_shape(vector)
        vector = parameters_subtraction(vector, pseudo_rand_gen(seed, SECAGG_MODULUS_RANGE, shapes))
        for node, pk1 in self.public_keys.items():
            if node == TARGET:
                continue
            shared = generate_shared_key(bytes_to_private_key(key), bytes_to_public_key(pk1))
            mask = pseudo_rand_gen(shared, SECAGG_MODULUS_RANGE, shapes)
            vector = (parameters_subtraction if node < TARGET else parameters_addition)(vector, mask)
        _, quantised = factor_extract(parameters_mod(vector, SECAGG_MODULUS_RANGE))
        clip = SETTINGS.user_dp.clipping_norm
        return np.concatenate([a.ravel() for a in dequantize(quantised, clip, SECAGG_QUANTIZATION_RANGE)])


def _attacked_round(
    release: tuple[Path, Path], work: Path, guarded: bool
) -> tuple[_Unmasker, dict, np.ndarray]:
    """One served round under the unmasking server: the grid, the round's record and TARGET's
    true contribution (its update, then the A.1 indicator)."""
    setup = rounds.make_setup(*release, work, SETTINGS, None)
    arrays = get_arrays(setup.model)
    rng = np.random.default_rng(11)
    deltas = [[rng.normal(0, 1e-3, a.shape).astype(np.float32) for a in arrays] for _ in range(NODES)]
    grid = _Unmasker({TARGET + i: _app(d, guarded) for i, d in enumerate(deltas)})
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with grid.serving():
        state = rounds.serve(grid, context, SETTINGS, setup, lambda _record: None)
    s = indicator_value(SETTINGS.user_dp.clipping_norm)
    truth = np.concatenate([*(d.ravel() for d in deltas[0]), [s]])
    return grid, state.records[-1], truth


@pytest.mark.usefixtures("quiet")
def test_a_device_refuses_to_unmask_a_node_listed_both_active_and_dropped(
    release: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Without the guard (Flower's client alone) every device sends both of TARGET's shares and
    the server reads TARGET's update to SecAgg+'s rounding; the project's devices refuse the
    request: no share of TARGET leaves them, the round releases nothing, each says why."""
    grid, _, truth = _attacked_round(release, tmp_path / "flower", guarded=False)
    read = grid.unmasked()
    assert read is not None and np.abs(read - truth).max() < 1e-4  # the attack is real

    with caplog.at_level(logging.WARNING, logger="nimmer_train.federation.mods"):
        grid, record, _ = _attacked_round(release, tmp_path / "guarded", guarded=True)
    assert grid.unmasked() is None and grid.seed_shares == [] and grid.key_shares == []
    assert not record["accepted"]
    refusals = [
        r.getMessage() for r in caplog.records if "refusing the server's SecAgg+ unmask" in r.getMessage()
    ]
    assert len(refusals) == NODES and all(f"[{TARGET}] listed both active and dropped" in r for r in refusals)


def test_an_unmask_request_is_checked_for_overlap_and_for_the_node_itself() -> None:
    """The check alone: an honest request passes; a node in both lists, or the answering node
    listed as dropped, is refused; a message of another stage is not the guard's."""
    honest = {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [1, 2, 3], Key.DEAD_NODE_ID_LIST: [4]}
    assert unmask_problem(honest, 2) is None
    both = {**honest, Key.DEAD_NODE_ID_LIST: [4, 3]}
    assert "[3] listed both active and dropped" in (unmask_problem(both, 2) or "")
    itself = {Key.STAGE: Stage.UNMASK, Key.ACTIVE_NODE_ID_LIST: [1, 3], Key.DEAD_NODE_ID_LIST: [2]}
    assert "this node (2) listed as dropped" in (unmask_problem(itself, 2) or "")
    assert unmask_problem({Key.STAGE: Stage.SETUP}, 2) is None and unmask_problem(None, 2) is None
    chain = client_app(lambda _ctx: None)._mods
    assert chain.index(unmask_guard_mod) == chain.index(secaggplus_mod) - 1  # it sees the request first
