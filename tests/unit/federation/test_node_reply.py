"""What a node's reply to a round carries (issue 20, items 1 and 4; issue 14): no contributor id,
no tier, no example count beside its clipped vector and A.1 indicator; a node that takes no part
answers with a one-line refusal, not a traceback in the federation's log, and keeps the reason in
its device's own log."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, Metadata, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import FitIns, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from nimmer_train.config.federated import FederatedConfig, LocalRecipeConfig, SecAggConfig, SimulationConfig
from nimmer_train.federation.app import client_app
from nimmer_train.federation.client import REFUSAL, Node, device_examples
from nimmer_train.federation.local_training import load_trainable
from nimmer_train.federation.population import build_population
from nimmer_train.federation.strategy import fit_config
from nimmer_train.federation.wire import A2_METRICS, AdapterSpec, get_arrays, indicator_value, spec_of
from nimmer_train.memory.contributions import entries
from nimmer_train.memory.synthetic import generate_player
from tests.helpers.memory import HashEmbedder


def _train_message(
    settings: FederatedConfig, arrays: list[np.ndarray], spec: AdapterSpec, round_: int = 1
) -> Message:
    """The fit instruction the server sends (its fit config plus what Flower's DP wrapper adds)."""
    config = {
        **fit_config(settings, spec),
        "round": round_,
        KEY_CLIPPING_NORM: settings.user_dp.clipping_norm,
    }
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(arrays), config), keep_input=True)
    metadata = Metadata(
        run_id=1,
        message_id=f"m{round_}",
        src_node_id=0,
        dst_node_id=7,
        reply_to_message_id="",
        group_id=str(round_),
        created_at=time.time(),
        ttl=600.0,
        message_type=MessageType.TRAIN,
    )
    return Message(content, metadata=metadata)


def _strings(record: RecordDict) -> list[str]:
    """Every text and scalar value a reply's records hold, as text."""
    out = []
    for records in (record.config_records, record.metric_records):
        for rec in records.values():
            out += [str(v) for v in rec.values()]
    return out


def test_a_nodes_reply_says_nothing_in_plaintext_about_who_or_how_much(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Items 1 and 4: no contributor id, no tier, no example count leave a node beside its vector;
    the vector is the update followed by the A.1 indicator (s for a real A.1 update), clipped as
    one under C; an opt-out device refuses the round and sends nothing."""
    base, adapter = release
    settings = FederatedConfig(
        secagg=SecAggConfig(
            enabled=False,  # the plain reply: what SecAgg+ would then mask, readable here
        ),
        local=LocalRecipeConfig(steps=2),
        simulation=SimulationConfig(
            contributors=2, population=["A1_federated", "opt_out"], entries_per_player=40
        ),
    )
    population = build_population(tmp_path / "devices", settings, HashEmbedder())
    model, _ = load_trainable(base, adapter)
    arrays, spec = get_arrays(model), spec_of(model)
    s = indicator_value(settings.user_dp.clipping_norm)
    for device, tier in zip(population.devices, population.tiers, strict=True):
        texts, contributor = device_examples(device)
        app = client_app(lambda _ctx, d=device: Node(base, adapter, device=d), secure_aggregation=False)
        context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
        if tier != "A1_federated":  # an opt-out device refuses the round: it sends nothing at all
            refused = app(_train_message(settings, arrays, spec), context)
            assert refused.has_error() and refused.error.reason == REFUSAL and not refused.has_content()
            continue
        reply = app(_train_message(settings, arrays, spec), context)
        assert not reply.has_error(), reply.error
        res = compat.recorddict_to_fitres(reply.content, keep_input=True)
        assert res.num_examples == 1  # every node weighs 1; its count stays on the device
        assert set(res.metrics) <= set(A2_METRICS) and not res.metrics
        *update, indicator = parameters_to_ndarrays(res.parameters)
        joint = np.sqrt(sum(float(np.sum(np.square(a, dtype=np.float64))) for a in [*update, indicator]))
        assert joint <= settings.user_dp.clipping_norm
        if tier == "A1_federated":
            assert texts and contributor
            assert indicator.tolist() == [s]
            assert any(np.abs(u).max() > 0 for u in update)
            assert not any(contributor in v for v in _strings(reply.content))


@pytest.mark.parametrize("tier", ["opt_out", "A2_anonymized"])
def test_a_refusing_node_answers_in_one_line_without_a_traceback(
    tmp_path: Path, tier: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The demo's population mixes tiers: its opt-out and A.2 devices (and A.1 players who share
    no category) refuse when sampled. The refusal was an exception, which Flower's simulation
    logged as two ERROR records with tracebacks per refusal; it is now an error reply (the node
    drops out as before, SecAgg+ recovers its masks) that says only REFUSAL, and one INFO line."""
    device = tmp_path / "device"
    generate_player(device, HashEmbedder(), seed=3, entries=20, player_id="player-77aa", tier=tier)
    settings = FederatedConfig(secagg=SecAggConfig(enabled=False))
    spec = AdapterSpec(("a", "b"), ((6, 4), (9,)))
    app = client_app(lambda _ctx: Node(tmp_path / "base", tmp_path / "adapter", device=device), False)
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.DEBUG):
        zeros = [np.zeros(shape, np.float32) for shape in spec.shapes]
        reply = app(_train_message(settings, zeros, spec, round_=2), context)
    assert reply.has_error() and reply.error.reason == REFUSAL and not reply.has_content()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    (line,) = [r.getMessage() for r in caplog.records if REFUSAL in r.getMessage()]
    assert line == f"round 2: {REFUSAL}" and tier not in line
    (refused,) = entries(device)  # the reason stays in the device's own log
    assert refused["kind"] == "refused" and refused["round"] == 2 and tier in refused["reason"]
