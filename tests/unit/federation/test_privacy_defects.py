"""The federation's published guarantees hold as implemented (issue 20), item by item: what a
node's reply carries (1, 4), where the noise comes from (2), the release threshold (4), the budget
checked before release and a stopped federation that stays stopped (5), every A.2 mechanism
accounted (6), and the edges: no noise without ``no_privacy``, SecAgg+'s overflow bound and its
rounding under the clipping norm (7). The whole federation's figures are checked in
test_federation.py (tiny_run)."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, Message, Metadata, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import (
    Code,
    FitIns,
    FitRes,
    Status,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from nimmer_train.config.federated import (
    SECAGG_MAX_NODES,
    SECAGG_MODULUS_RANGE,
    SECAGG_QUANTIZATION_RANGE,
    A2Config,
    FederatedConfig,
    LocalDPConfig,
    LocalRecipeConfig,
    SecAggConfig,
    SimulationConfig,
    UserDPConfig,
)
from nimmer_train.errors import ConfigError
from nimmer_train.federation import budget, checkpoint, results, rounds
from nimmer_train.federation.app import client_app
from nimmer_train.federation.client import REFUSAL, Node, device_examples, example_text
from nimmer_train.federation.local_training import LocalTrainingConfig, load_trainable, train_locally
from nimmer_train.federation.mods import contribution
from nimmer_train.federation.population import build_population
from nimmer_train.federation.strategy import NoisyMean, RoundOutcome, fit_config
from nimmer_train.federation.wire import (
    A2_METRICS,
    QUANTUM,
    AdapterSpec,
    get_arrays,
    indicator_value,
    spec_of,
)
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish import card
from tests.helpers.flower_deployment import tiny_release
from tests.helpers.memory import HashEmbedder

SPEC = AdapterSpec(("a", "b"), ((6, 4), (9,)))


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base, adapter, _ = tiny_release(tmp_path_factory.mktemp("release"))
    return base, adapter


# --- item 1 and 4: what a node's reply carries -------------------------------------------------


def _train_message(settings: FederatedConfig, arrays: list[np.ndarray], spec: AdapterSpec) -> Message:
    """The fit instruction the server sends (its fit config plus what Flower's DP wrapper adds)."""
    config = {
        **fit_config(settings, spec),
        "round": 1,
        KEY_CLIPPING_NORM: settings.user_dp.clipping_norm,
    }
    content = compat.fitins_to_recorddict(FitIns(ndarrays_to_parameters(arrays), config), keep_input=True)
    metadata = Metadata(
        run_id=1,
        message_id="m1",
        src_node_id=0,
        dst_node_id=7,
        reply_to_message_id="",
        group_id="1",
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


def _results(a1: int, others: int, settings: FederatedConfig, a2: list[tuple] = ()) -> list[tuple]:
    """FitRes of ``a1`` real A.1 contributions, ``others`` empty ones (opt-out, A.2 devices), and
    one per A.2 node step in ``a2``, as the plain (non-SecAgg) workflow hands them over."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(a1 + others + len(a2)):
        update = [
            rng.normal(size=shape) if i < a1 or i >= a1 + others else np.zeros(shape) for shape in SPEC.shapes
        ]
        arrays = contribution(update, i < a1, settings.user_dp.clipping_norm, 0.0)
        metrics = {}
        if i >= a1 + others:
            noise, rate, steps = a2[i - a1 - others]
            metrics = {"a2-noise": noise, "a2-sample-rate": rate, "a2-steps": steps}
        out.append((None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics)))
    return out


def test_a_round_with_fewer_real_a1_updates_than_the_threshold_releases_nothing() -> None:
    """Item 4: five nodes answered, but only one carries a real A.1 update: the server could
    subtract the known rest and read it, so the round releases nothing (before, every node
    counted toward min_participants)."""
    settings = FederatedConfig(min_participants=3, secagg=SecAggConfig(enabled=False))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    released, _ = strategy.aggregate_fit(1, _results(a1=1, others=4, settings=settings), [])
    assert released is None and strategy.outcome.update is None
    assert strategy.outcome.reason == (
        "fewer real A.1 updates in the sum than federated.min_participants=3"  # no count in it
    )
    strategy = NoisyMean(
        FederatedConfig(
            min_participants=3,
            secagg=SecAggConfig(enabled=False),
            user_dp=UserDPConfig(noise_multiplier=0.01),
        ),
        SPEC,
        fit_config(settings, SPEC),
    )
    strategy.aggregate_fit(1, _results(a1=3, others=2, settings=settings), [])
    assert strategy.outcome.accepted and strategy.outcome.update is not None
    assert strategy.outcome.a1_noised == pytest.approx(3, abs=0.2)  # noise std 2 z = 0.02


# --- item 2: the noise comes from the OS's entropy ---------------------------------------------


def test_a_nodes_update_cannot_be_recomputed_from_the_server_configuration(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Item 2: everything the server knows (global adapter, recipe, seed), even the node's own
    texts, run twice: two different updates. Before, the seed fixed the noise and the masks."""
    base, adapter = release
    warnings.filterwarnings("ignore")
    model, _ = load_trainable(base, adapter)
    arrays = get_arrays(model)
    texts = [example_text(e) for e in heldout_examples(24, seed=5)]
    recipe = LocalTrainingConfig(
        LocalRecipeConfig(steps=2, batch_size=8, lr=3.0, max_length=32, max_examples=64),
        LocalDPConfig(noise_multiplier=1.0, max_grad_norm=0.1, grad_sample_mode="hooks"),
        seed=7,
    )
    one = train_locally(base, adapter, arrays, texts, recipe, tmp_path / "one.json", 1e-5)
    two = train_locally(base, adapter, arrays, texts, recipe, tmp_path / "two.json", 1e-5)
    assert not all(np.array_equal(a, b) for a, b in zip(one.arrays, two.arrays, strict=True))


def test_the_servers_noise_does_not_follow_numpys_global_seed() -> None:
    """Item 2, server side: the Gaussian noise on the sum comes from an OS-entropy generator."""
    settings = FederatedConfig(min_participants=3, secagg=SecAggConfig(enabled=False))
    updates = []
    for _ in range(2):
        np.random.seed(0)
        strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
        strategy.aggregate_fit(1, _results(a1=3, others=0, settings=settings), [])
        updates.append(strategy.outcome.update)
    assert not all(np.array_equal(a, b) for a, b in zip(*updates, strict=True))


# --- items 5 and 6: the budget before release, every A.2 step, a stop that stays ---------------


class _Strategy:
    def __init__(self, outcome: RoundOutcome) -> None:
        self.outcome = outcome


def _loop(settings: FederatedConfig, ledger: Ledger, outcome: RoundOutcome, work: Path) -> Any:
    """A round loop whose fit round "happened" with ``outcome`` (no Flower, no nodes)."""
    return rounds._RoundLoop(
        grid=None,
        settings=settings,
        setup=SimpleNamespace(a2_pool=None, work=work),
        spec=SPEC,
        ledger=ledger,
        strategy=_Strategy(outcome),
        legacy=SimpleNamespace(state=SimpleNamespace(array_records={})),
        fit=lambda grid, legacy: None,
        round_config={},
    )


def test_every_a2_node_of_a_round_is_accounted() -> None:
    """Item 6: two A.2 nodes in one round: both DP-SGD runs reach the ledger (before, the last
    one's step overwrote the first's). Each claims the configured step, the only one the server
    accepts (tests/unit/federation/test_review_attacks.py)."""
    settings = FederatedConfig(min_participants=3, secagg=SecAggConfig(enabled=False))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    a2 = [budget.planned_a2(settings)] * 2
    strategy.aggregate_fit(1, _results(a1=3, others=1, settings=settings, a2=a2), [])
    assert strategy.outcome.a2_steps == a2


def test_a_round_over_budget_by_its_actual_steps_is_discarded_and_the_federation_stays_stopped(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Item 5: the plan assumed the A.2 rate 1/93 (93 batches); the node reports Opacus's 1/92.
    With the budget between the two, the round is discarded before release (no arrays adopted,
    nothing accounted), the federation stops with its reason in the state, and a restart neither
    crashes nor runs a round (before, the BudgetExceeded escaped serve on every restart)."""
    a1_step = (5.0, 0.1, 1)  # epsilon 0.12: the A.2 ledger is the one at the budget
    planned, actual = (1.0, 1 / 93, 40), (1.0, 1 / 92, 40)
    low = Ledger(1e-5).after(a1_step, [planned])["a2_record_level"]
    high = Ledger(1e-5).after(a1_step, [actual])["a2_record_level"]
    assert low < high
    settings = FederatedConfig(
        epsilon_budget=(low + high) / 2, heldout_examples=4, secagg=SecAggConfig(enabled=False)
    )
    ledger = Ledger(settings.delta, settings.epsilon_budget)
    ledger.plan(a1_step, [planned])  # the round's plan fits
    update = [np.full(shape, 0.5, np.float32) for shape in SPEC.shapes]
    outcome = RoundOutcome(sampled=4, participants=4, accepted=True, update=update, a2_steps=[actual])
    work = tmp_path / "rounds"
    loop = _loop(settings, ledger, outcome, work)
    before = [np.zeros(shape, np.float32) for shape in SPEC.shapes]
    arrays, record, stopping = rounds._run_round(loop, 1, a1_step, before, [])
    assert arrays is before and ledger.a1 == [] and ledger.a2 == []
    assert not record["accepted"] and record["reason"].startswith("discarded before release")
    assert "heldout_loss" not in record and stopping and stopping.startswith("budget")
    # the stop goes into the state; a restarted server reads it and does not resume
    base, adapter = release
    setup = rounds.make_setup(base, adapter, work, settings, None)
    work.mkdir()
    state = checkpoint.ServerState(initial_loss=1.0, ledger={})
    rounds._checkpoint(
        state, SimpleNamespace(ledger=ledger, setup=setup), record, get_arrays(setup.model), stopping
    )
    saved = json.loads((work / checkpoint.STATE_FILE).read_text())
    assert saved["stopped"] == stopping and saved["round"] == 1
    for _ in range(2):
        reported: list[dict] = []
        again = rounds.serve(None, None, settings, setup, reported.append)  # type: ignore[arg-type]
        assert again.stopped == stopping and again.round == 1 and reported == []


# --- item 7: the edges -------------------------------------------------------------------------


NO_NOISE = {
    "user_dp.noise_multiplier": {"user_dp": UserDPConfig(noise_multiplier=0.0)},
    "local_dp.noise_multiplier": {"local_dp": LocalDPConfig(noise_multiplier=0.0)},
    "a2.count_noise_multiplier": {"a2": A2Config(count_noise_multiplier=0.0)},
}


@pytest.mark.parametrize("name", sorted(NO_NOISE))
def test_no_noise_is_refused_unless_the_experiment_says_no_privacy(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"federated\.{re.escape(name)}.*no_privacy"):
        FederatedConfig(**NO_NOISE[name])
    assert FederatedConfig(**NO_NOISE[name], no_privacy=True).no_privacy
    with pytest.raises(ConfigError, match="epsilon_budget"):
        FederatedConfig(no_privacy=True, epsilon_budget=8.0)
    presets = FederatedConfig(user_dp=UserDPConfig(noise_multiplier=0.01))  # the presets stay valid
    assert presets.user_dp.noise_multiplier == 0.01


def test_a_no_privacy_federation_publishes_no_epsilon(tmp_path: Path) -> None:
    settings = FederatedConfig(
        no_privacy=True,
        user_dp=UserDPConfig(noise_multiplier=0.0),
        local_dp=LocalDPConfig(noise_multiplier=0.0),
    )
    ledger = Ledger(settings.delta)
    ledger.record((0.0, 1.0, 1), [(0.0, 0.25, 6)])
    state = checkpoint.ServerState(
        round=1,
        stopped="completed",
        records=[{"round": 1, "accepted": True, "a1_contributions_noised": 3.0, "heldout_loss": 1.0}],
        ledger=json.loads(json.dumps(ledger.__dict__)),
        pool_counts={"released": True, "uploads": 2.4, "categories": {"lore": 5.2}, "noise_std": 7.07},
    )
    data = results.contributed_data(settings, state)
    assert (
        data["tiers"]["A1_federated"]["epsilon"] is None and data["tiers"]["A2_anonymized"]["epsilon"] is None
    )
    assert "No privacy guarantee" in results.render_card("f" * 16, "caste-preacher", data)
    manifest = {
        "version_label": "nimmerworld-base-v2",
        "version_id": "id",
        "base_model_origin": "scratch:llama-tiny",
        "released_at": "now",
        "parent_version": None,
        "merged_adapter": None,
        "training_recipe_ref": {"git_commit": "abc", "base_config_hash": "0" * 16},
        "training_corpus_refs": {
            "literary": {"name": "lit", "fingerprint": "0" * 16},
            "player_contributed": {
                "A1_federated": {"contributors": 3},
                "A2_anonymized": {"uploads": 2},
                "counts_noised": True,
            },
        },
        "differential_privacy_epsilon": None,
        "contributors_count": 5,
        "privacy": {
            "delta": 1e-5,
            "epsilon_a1_user_level": None,
            "epsilon_a2_record_level": None,
            "no_privacy": True,
            "counts_noised": True,
            "contributors_a1": 3,
            "uploads_a2": 2,
            "never_shared": ["clasp"],
        },
    }
    privacy = card.render(manifest, "apache-2.0").split("## Privacy")[1]
    assert "No privacy guarantee" in privacy and "epsilon" not in privacy.replace("no epsilon", "")


def test_secagg_overflow_is_refused_before_it_happens() -> None:
    """Item 7: n nodes' quantised values (each up to 2^22, and each node's weight factor 2^22)
    sum modulo 2^32: 1024 nodes wrap to 0. A configuration or a round that could reach it is
    refused with the bound named."""
    assert (SECAGG_MAX_NODES + 1) * SECAGG_QUANTIZATION_RANGE % SECAGG_MODULUS_RANGE == 0
    assert SECAGG_MAX_NODES * SECAGG_QUANTIZATION_RANGE < SECAGG_MODULUS_RANGE
    FederatedConfig(
        simulation=SimulationConfig(contributors=SECAGG_MAX_NODES - 1)
    )  # with the A.2 node: 1023 nodes, all sampled
    with pytest.raises(ConfigError, match="1023 nodes per round.*overflows"):
        FederatedConfig(simulation=SimulationConfig(contributors=SECAGG_MAX_NODES))
    # Poisson cohorts vary: an expected 1000 of 100,000 may pass 1023; 500 of them stays clear
    with pytest.raises(ConfigError, match="expected cohort of 1000"):
        FederatedConfig(
            user_dp=UserDPConfig(fraction_fit=0.01), simulation=SimulationConfig(contributors=99_999)
        )
    FederatedConfig(
        user_dp=UserDPConfig(fraction_fit=0.005), simulation=SimulationConfig(contributors=99_999)
    )
    FederatedConfig(
        secagg=SecAggConfig(enabled=False), simulation=SimulationConfig(contributors=SECAGG_MAX_NODES)
    )  # no SecAgg+: no bound

    class Proxy(ClientProxy):
        get_properties = get_parameters = fit = evaluate = reconnect = None  # type: ignore[assignment]

    manager = SimpleClientManager()
    for i in range(SECAGG_MAX_NODES + 1):
        manager.register(Proxy(str(i)))
    settings = FederatedConfig()
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    assert strategy.configure_fit(1, ndarrays_to_parameters([]), manager) == []
    assert strategy.outcome.stop and re.search(r"1024 nodes sampled.*at most 1023", strategy.outcome.stop)


def test_secaggs_rounding_keeps_a_contribution_under_the_clipping_norm() -> None:
    """Item 7: a contribution clipped exactly to C leaves SecAgg+ (float32 quantisation with
    stochastic rounding, then dequantisation) with a norm above C about half the time; clipped to
    wire.contribution_bound it never does. Flower's own quantize/dequantize, our SecAgg+ ranges."""
    settings = FederatedConfig(user_dp=UserDPConfig(clipping_norm=10.0))
    workflow = rounds._fit_workflow(settings)
    clip_range, quant_range = workflow.clipping_range, workflow.quantization_range
    quantum = fit_config(settings, SPEC)[QUANTUM]
    assert quantum == 2 * clip_range / quant_range
    rng = np.random.default_rng()
    norms = []
    for trial in range(40):
        update = [rng.normal(size=(200, 100)), rng.normal(size=(1000,))]
        sent = contribution(update, trial % 2 == 0, settings.user_dp.clipping_norm, quantum)
        received = dequantize(quantize(sent, clip_range, quant_range), clip_range, quant_range)
        norms.append(float(np.sqrt(sum(float(np.sum(np.square(r))) for r in received))))
    assert max(norms) <= settings.user_dp.clipping_norm
    assert min(norms) > settings.user_dp.clipping_norm - 0.01  # and the margin costs nearly nothing
