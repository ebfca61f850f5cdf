"""What a run that is not a guarantee looks like (issue 14): a node that takes no part answers its
round with a one-line refusal, not a traceback in the federation's log; and an epsilon that bounds
nothing (experiment=ci_tiny's plumbing federation, ~11,000) is labelled wherever it is shown."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Context, Message, Metadata, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import FitIns, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation import results, rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.client import REFUSAL, Node
from nimmer_train.federation.wire import AdapterSpec
from nimmer_train.memory.contributions import entries
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish import card
from tests.helpers.compose import config
from tests.helpers.memory import HashEmbedder


def _train_message(settings: FederatedConfig, spec: AdapterSpec) -> Message:
    config_ = {**rounds.fit_config(settings, spec), "round": 2, KEY_CLIPPING_NORM: settings.clipping_norm}
    arrays = [np.zeros(shape, np.float32) for shape in spec.shapes]
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(arrays), config_), keep_input=True)
    metadata = Metadata(
        run_id=1,
        message_id="m2",
        src_node_id=0,
        dst_node_id=7,
        reply_to_message_id="",
        group_id="2",
        created_at=time.time(),
        ttl=600.0,
        message_type=MessageType.TRAIN,
    )
    return Message(content, metadata=metadata)


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
    settings = FederatedConfig(secure_aggregation=False)
    spec = AdapterSpec(("a", "b"), ((6, 4), (9,)))
    app = client_app(lambda _ctx: Node(tmp_path / "base", tmp_path / "adapter", device=device), False)
    context = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})
    with caplog.at_level(logging.DEBUG):
        reply = app(_train_message(settings, spec), context)
    assert reply.has_error() and reply.error.reason == REFUSAL and not reply.has_content()
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.WARNING]
    (line,) = [r.getMessage() for r in caplog.records if REFUSAL in r.getMessage()]
    assert line == f"round 2: {REFUSAL}" and tier not in line
    (refused,) = entries(device)  # the reason stays in the device's own log
    assert refused["kind"] == "refused" and refused["round"] == 2 and tier in refused["reason"]


def _published(settings: FederatedConfig, rounds_: int) -> dict:
    """What a federation of ``settings`` that released ``rounds_`` rounds publishes."""
    ledger = Ledger(settings.delta)
    for _ in range(rounds_):
        ledger.record((settings.noise_multiplier, settings.fraction_fit, 1), [(1.0, 1 / 16, 6)])
    state = rounds.ServerState(
        round=rounds_,
        stopped="completed",
        records=[{"round": r + 1, "accepted": True, "a1_contributions_noised": 3.0} for r in range(rounds_)],
        ledger=json.loads(json.dumps(ledger.__dict__)),
    )
    return results.contributed_data(settings, state)


def test_an_epsilon_that_bounds_nothing_is_labelled_wherever_it_is_shown() -> None:
    """ci_tiny keeps six contributors at z = 0.01 (plumbing: at z = 1 the noise on their mean
    would be ~20x the signal); its A.1 epsilon, ~11,000 at 1e-5, is labelled in the data card, in
    the text the model card quotes for it, and in the adapter's metadata; the demo's is not."""
    tiny = config("experiment=ci_tiny").federated
    data = _published(tiny, tiny.rounds)
    eps = data["tiers"]["A1_federated"]["epsilon"]
    assert eps > 10_000 and set(data["caveats"]) == {"epsilon_a1_user_level"}
    assert data["mechanisms"]["epsilon_a1_user_level"].startswith("NO MEANINGFUL GUARANTEE: epsilon 11,")
    data_card = results.render_card("f" * 16, "drunk-scavenger", data)
    assert "**NO MEANINGFUL GUARANTEE" in data_card and f"{eps:.3f} (no meaningful guarantee)" in data_card
    privacy = {
        "delta": tiny.delta,
        "epsilon_a1_user_level": eps,
        "epsilon_a2_record_level": data["tiers"]["A2_anonymized"]["epsilon"],
        "mechanisms": data["mechanisms"],
        "contributors_a1": 3,
        "uploads_a2": 2,
        "never_shared": ["clasp"],
    }
    manifest = {
        "version_label": "v1",
        "version_id": "id",
        "base_model_origin": "scratch:llama-tiny",
        "released_at": "now",
        "parent_version": None,
        "merged_adapter": None,
        "training_recipe_ref": {"git_commit": "abc", "base_config_hash": "0" * 16},
        "training_corpus_refs": {
            "literary": {"name": "lit", "fingerprint": "0" * 16},
            "player_contributed": {"A1_federated": {"contributors": 3}, "A2_anonymized": {"uploads": 2}},
        },
        "differential_privacy_epsilon": privacy["epsilon_a2_record_level"],
        "contributors_count": 5,
        "privacy": privacy,
    }
    model_card = card.render(manifest, "apache-2.0")
    assert "covers: NO MEANINGFUL GUARANTEE" in model_card
    demo = config("experiment=demo").federated
    shown = _published(demo, demo.rounds)
    assert shown["caveats"] == {} and "MEANINGFUL" not in results.render_card("f" * 16, "r", shown)
