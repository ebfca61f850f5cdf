"""A node cannot scale the honest updates of its round through its SecAgg+ weight. SecAgg+ masks
each node's weight with its vector and divides the unmasked sum by the total weight; the round
loop multiplies that mean back by the number of replies. A node reporting weight 0 made the
release n / (n - 1) times the honest sum, any other weight any multiple, with the noise unchanged
(the user-level guarantee broken, the round accepted). The server now releases a round only when
its unmasked total weight is exactly what n honest replies give, and spends nothing on the others.

The rounds run the real server loop (``rounds.serve``: NoisyMean, the SecAgg+ workflow, the
ledger) against ClientApps with Flower's ``secaggplus_mod`` and the project's client mods, over an
in-process grid (tests/helpers/loopback_grid.py: Flower's code throughout, no transport)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.client.mod import secaggplus_mod
from flwr.clientapp.typing import ClientAppCallable
from flwr.compat.common import recorddict_compat as compat

from nimmer_train.config.federated import (
    SECAGG_QUANTIZATION_RANGE,
    FederatedConfig,
    SimulationConfig,
    UserDPConfig,
)
from nimmer_train.federation import rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.wire import A1_UPDATE, get_arrays, secagg_quantum
from tests.helpers.loopback_grid import LoopbackGrid

NODES = 5
SETTINGS = FederatedConfig(
    rounds=1,
    min_participants=3,
    heldout_examples=4,
    user_dp=UserDPConfig(fraction_fit=1.0, noise_multiplier=1e-9),  # noise std z C = 1e-8 on the sum
    simulation=SimulationConfig(contributors=NODES - 1),  # N = 5 nodes, all sampled: q N = 5
)
# What the released sum may differ from the honest one by, per coordinate: each node's
# quantisation (< 2 steps, wire.contribution_bound) plus six standard deviations of the noise.
# The noise was once 1e-5 (z = 1e-6): the largest of 14,336 draws crossed a fixed 5e-5 in CI.
TOLERANCE = NODES * 2 * secagg_quantum(SETTINGS.user_dp.clipping_norm, SECAGG_QUANTIZATION_RANGE) + 6 * (
    SETTINGS.user_dp.noise_multiplier * SETTINGS.user_dp.clipping_norm
)


class _Trainer(NumPyClient):
    """A device whose training moved the adapter by ``delta`` (a real A.1 update)."""

    def __init__(self, delta: list[np.ndarray]) -> None:
        self.delta = delta

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple:
        return [p + d for p, d in zip(parameters, self.delta, strict=True)], 1, {A1_UPDATE: True}


def _weight(weight: int):  # noqa: ANN202 - a Flower mod
    """A forging node's mod, just inside SecAgg+: it reports ``weight`` instead of the 1 every
    node of the project reports (SuperNodes are not authenticated: a node runs what it likes)."""

    def mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        out = call_next(msg, ctxt)
        if out.has_error():
            return out
        res = compat.recorddict_to_fitres(out.content, keep_input=True)
        res.num_examples = weight
        out.content = compat.fitres_to_recorddict(res, keep_input=True)
        return out

    return mod


def _app(delta: list[np.ndarray], weight: int | None = None) -> ClientApp:
    """A node with the project's mod chain (``app.client_app``'s); a forger adds ``_weight`` just
    inside SecAgg+."""
    mods = list(client_app(lambda _ctx: None)._mods)
    if weight is not None:
        mods.insert(mods.index(secaggplus_mod) + 1, _weight(weight))
    return ClientApp(client_fn=lambda _ctx: _Trainer(delta).to_client(), mods=mods)


def _round(release: tuple[Path, Path], work: Path, forged: int | None) -> tuple[dict, np.ndarray, np.ndarray]:
    """One served round of NODES nodes (the last one forging ``forged``, if given): the round's
    record and ledger, the released sum (the adopted change times q N) and the honest nodes' sum."""
    setup = rounds.make_setup(*release, work, SETTINGS, None)
    before = [a.copy() for a in get_arrays(setup.model)]
    rng = np.random.default_rng(7)
    deltas = [[rng.normal(0, 1e-3, a.shape).astype(np.float32) for a in before] for _ in range(NODES)]
    apps = {
        101 + i: _app(d, forged if forged is not None and i == NODES - 1 else None)
        for i, d in enumerate(deltas)
    }
    context = Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={})
    grid = LoopbackGrid(apps)
    with grid.serving():
        state = rounds.serve(grid, context, SETTINGS, setup, lambda _record: None)
    after = get_arrays(setup.model)
    released = np.concatenate([(a - b).ravel() for a, b in zip(after, before, strict=True)]) * NODES
    honest = deltas if forged is None else deltas[:-1]
    expected = np.concatenate([np.sum([d[i] for d in honest], axis=0).ravel() for i in range(len(before))])
    return {"record": state.records[-1], "ledger": state.ledger}, released, expected


@pytest.mark.usefixtures("quiet")
def test_an_honest_secagg_round_releases_the_sum_of_its_updates(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """The control: five honest nodes under SecAgg+; the round is released and accounted, and
    what it adds is their sum over q N (quantisation and the tiny noise aside)."""
    out, released, expected = _round(release, tmp_path, None)
    assert out["record"]["accepted"], out["record"]["reason"]
    assert len(out["ledger"]["a1"]) == 1
    np.testing.assert_allclose(released, expected, rtol=0, atol=TOLERANCE)


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize("weight", [0, -2, 1021])
def test_a_node_reporting_another_weight_cannot_scale_the_round(
    release: tuple[Path, Path], tmp_path: Path, weight: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Four honest nodes and one reporting ``weight``: before, the round was released and
    accounted at 1.25 (weight 0: 5 / 4), 2.45 (weight -2: 5 / 2) and 51.6 (weight 1021: the total
    wraps modulo 2^32 to a single node's, 5 times the sum with the forger's own vector clipped at
    C per coordinate) times the honest sum. Now it releases nothing, spends nothing, and says why
    in one line."""
    with caplog.at_level(logging.WARNING, logger="nimmer_train.federation.strategy"):
        out, released, expected = _round(release, tmp_path, weight)
    record = out["record"]
    assert not record["accepted"] and np.all(released == 0)
    assert "total weight" in record["reason"], record["reason"]
    assert out["ledger"]["a1"] == [] and out["ledger"]["rounds"][-1]["released"] is False
    lines = [r.getMessage() for r in caplog.records if "total weight" in r.getMessage()]
    assert len(lines) == 1 and "round 1" in lines[0]
