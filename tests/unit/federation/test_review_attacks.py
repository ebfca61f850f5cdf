"""Attacks from a review of issue 20's fixes, each a test that failed before its fix:

- the published A.2 epsilon told the pool's size (Opacus's rate 1 / ceil(n / 16) moved with one
  example at a boundary, 48 -> 49), and an empty Poisson batch left the weights unmoved;
- any node could claim an A.2 step in plaintext: a rate of 2 crashed the server's accounting, a
  NaN hung it, a huge step count stopped the federation for good;
- nodes were sampled max(int(q N), min_participants) at a time from Python's global generator,
  more than the accounted Poisson rate q (3 of 7 at q = 0.2) and reproducible from a seed;
- plain FedAvg averaged in float32: one contribution moved the released sum by more than C.
"""

from __future__ import annotations

import logging
import math
import random
import warnings
from pathlib import Path

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from nimmer_train.config.federated import (
    A2Config,
    FederatedConfig,
    LocalDPConfig,
    LocalRecipeConfig,
    SecAggConfig,
    UserDPConfig,
)
from nimmer_train.federation import budget, checkpoint, rounds
from nimmer_train.federation.client import Contributor, Node, example_text
from nimmer_train.federation.local_training import LocalTrainingConfig, load_trainable, train_locally
from nimmer_train.federation.mods import contribution
from nimmer_train.federation.strategy import NoisyMean, fit_config
from nimmer_train.federation.wire import A2_METRICS, AdapterSpec, get_arrays, indicator_value
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.a2_pool import A2Pool
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.privacy.anonymize import anonymize
from tests.helpers.flower_deployment import tiny_release

SPEC = AdapterSpec(("a", "b"), ((6, 4), (9,)))


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base, adapter, _ = tiny_release(tmp_path_factory.mktemp("release"))
    return base, adapter


@pytest.fixture(autouse=True)
def _quiet() -> None:
    logging.getLogger("flwr").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")


def _fit_res(arrays: list[np.ndarray], metrics: dict | None = None) -> tuple[None, FitRes]:
    return None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics or {})


def _a1_results(settings: FederatedConfig, count: int) -> list[tuple[None, FitRes]]:
    rng = np.random.default_rng(0)
    return [
        _fit_res(
            contribution([rng.normal(size=s) for s in SPEC.shapes], True, settings.user_dp.clipping_norm, 0.0)
        )
        for _ in range(count)
    ]


# --- the A.2 node: its step and its update say nothing about the pool's size --------------------


def _pool(folder: Path, examples: int) -> Path:
    """An A.2 intake of two uploads (k = 2) holding ``examples`` examples in all."""
    path = folder / f"pool-{examples}" / "a2_pool.sqlite"
    pool = A2Pool(path, 2)
    rows = [
        {
            "speaker": "npc:oran",
            "text": f"the ferry bell rang {i} times at dusk",
            "data_category": "casual_dialog",
        }
        for i in range(examples)
    ]
    half = examples // 2
    for i, part in enumerate((rows[:half], rows[half:])):
        pool.add(anonymize(part, f"player-{i}", f"Name{i}"))
    pool.close()
    return path


def test_the_a2_nodes_accounting_step_does_not_depend_on_the_pools_size(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    """Before: Opacus's rate 1 / ceil(n / 16) was reported and published through the A.2 epsilon,
    so one example at a boundary (48 -> 49) changed it with certainty. After: every pool size gives
    the step the settings fix, the only one the server accepts."""
    base, adapter = release
    settings = FederatedConfig(local=LocalRecipeConfig(steps=2, max_length=24))
    model, _ = load_trainable(base, adapter)
    arrays = get_arrays(model)
    config = {**fit_config(settings, rounds.spec_of(model)), "round": 1}
    steps = set()
    for examples in (48, 49, 300):  # 300: beyond max_examples (256), every example is still used
        node = Node(base, adapter, a2_pool=_pool(tmp_path, examples))
        _, _, metrics = Contributor(node).fit(arrays, config)
        steps.add(tuple(metrics[k] for k in A2_METRICS))
    assert len(steps) == 1 and steps == {budget.planned_a2(settings)}  # before: 1/3, 1/4, 1/16
    assert budget.planned_a2(settings)[1] == 1 / 16  # batch_size / max_examples, whatever the pool


def test_an_empty_poisson_batch_still_takes_the_noisy_step(
    release: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before: an empty batch was accounted but skipped, so the weights did not move exactly when
    no record was drawn (and a run of empty batches failed the lora_changed check). After: the
    noise-only step Opacus's optimizer takes, accounted."""
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler

    def nothing_drawn(self: UniformWithReplacementSampler):  # noqa: ANN202
        for _ in range(self.steps):
            yield []

    monkeypatch.setattr(UniformWithReplacementSampler, "__iter__", nothing_drawn)
    base, adapter = release
    model, _ = load_trainable(base, adapter)
    arrays = get_arrays(model)
    recipe = LocalTrainingConfig(
        LocalRecipeConfig(steps=3, batch_size=4, lr=3.0, max_length=24, max_examples=64),
        LocalDPConfig(noise_multiplier=1.0, max_grad_norm=0.1, grad_sample_mode="hooks"),
        seed=0,
    )
    texts = [example_text(e) for e in heldout_examples(16, seed=4)]  # rate 1/4, expected batch 4
    result = train_locally(base, adapter, arrays, texts, recipe, tmp_path / "acc.json", 1e-5)
    moved = [np.abs(a - b).max() for a, b in zip(result.arrays, arrays, strict=True)]
    assert max(moved) > 0 and result.steps == 3 and result.epsilon and result.epsilon > 0
    # each step's noise on the mean: std z * clip / expected batch = 1.0 * 0.1 / 4; lr 3 -> 0.075
    delta = np.concatenate([(a - b).ravel() for a, b in zip(result.arrays, arrays, strict=True)])
    assert delta.std() == pytest.approx(0.075 * math.sqrt(3), rel=0.1)


# --- the A.2 step a reply claims in plaintext -----------------------------------------------------


@pytest.mark.parametrize(
    "claim",
    [
        (1.0, 2.0, 6),  # a rate above 1: Opacus's RDP raised (math domain error), crashing serve
        (float("nan"), 0.0625, 6),  # Opacus's RDP never returned: the server hung
        (1.0, 0.0625, 10**6),  # a million steps: over any budget, the federation stopped for good
        (0.01, 0.0625, 6),  # a noise the server never sent
        ("x", 0.0625, 6),
    ],
)
def test_a_node_cannot_claim_an_a2_step_other_than_the_configured_one(claim: tuple) -> None:
    settings = FederatedConfig(min_participants=3, secagg=SecAggConfig(enabled=False))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    forged = _fit_res(
        contribution([np.zeros(s) for s in SPEC.shapes], False, settings.user_dp.clipping_norm, 0.0),
        dict(zip(A2_METRICS, claim, strict=True)),
    )
    released, _ = strategy.aggregate_fit(1, [*_a1_results(settings, 3), forged], [])
    assert released is None and not strategy.outcome.accepted and strategy.outcome.a2_steps == []
    assert strategy.outcome.reason.startswith("aggregate rejected: an A.2 accounting step")
    # the A.2 node's own claim is the configured step, and it is accounted
    honest = _fit_res(parameters_of(forged), dict(zip(A2_METRICS, budget.planned_a2(settings), strict=True)))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    strategy.aggregate_fit(1, [*_a1_results(settings, 3), honest], [])
    assert strategy.outcome.accepted and strategy.outcome.a2_steps == [budget.planned_a2(settings)]
    assert Ledger(settings.delta).after(None, strategy.outcome.a2_steps)["a2_record_level"] > 0


def parameters_of(res: tuple[None, FitRes]) -> list[np.ndarray]:
    from flwr.common import parameters_to_ndarrays

    return parameters_to_ndarrays(res[1].parameters)


# --- which nodes a round takes ---------------------------------------------------------------------


class _Proxy(ClientProxy):
    get_properties = get_parameters = fit = evaluate = reconnect = None  # type: ignore[assignment]


def test_nodes_are_poisson_sampled_at_the_accounted_rate_from_the_os_entropy() -> None:
    """Before: FedAvg took max(int(0.2 * 7), min_participants = 3) = 3 of 7 nodes every round,
    a rate of 0.43 accounted as 0.2 (epsilon 5.75 published for 10.27 spent over ten rounds at
    z = 1), drawn by random.sample: the same nodes after the same random.seed."""
    settings = FederatedConfig(min_participants=3, user_dp=UserDPConfig(fraction_fit=0.2))
    manager = SimpleClientManager()
    for i in range(7):
        manager.register(_Proxy(str(i)))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    samples = []
    for _ in range(600):
        random.seed(0)
        samples.append(
            frozenset(p.cid for p, _ in strategy.configure_fit(1, ndarrays_to_parameters([]), manager))
        )
    rate = sum(len(s) for s in samples) / (7 * len(samples))
    assert rate == pytest.approx(0.2, abs=0.04)  # binomial sd 0.006
    assert len(set(samples)) > 20  # not fixed by Python's global seed
    everyone = NoisyMean(FederatedConfig(), SPEC, fit_config(settings, SPEC))
    assert len(everyone.configure_fit(1, ndarrays_to_parameters([]), manager)) == 7  # q = 1: all


# --- the released sum's sensitivity -------------------------------------------------------------------


def test_one_contribution_moves_the_plain_sum_by_at_most_c() -> None:
    """The sum the noise goes on has sensitivity C. Before: FedAvg's float32 average, times n, let
    one contribution beside 600 others move it by 1.00001 C (plain FedAvg, simulation only). The
    float32 cast of the noisy mean afterwards is post-processing."""
    spec = AdapterSpec(("a",), ((99,),))
    settings = FederatedConfig(secagg=SecAggConfig(enabled=False), user_dp=UserDPConfig(clipping_norm=1.0))
    strategy = NoisyMean(settings, spec, fit_config(settings, spec))

    def summed(first: np.ndarray) -> np.ndarray:
        nodes = [(first, bool(first.any())), *[(np.full(99, 0.9), True)] * 600]
        results = [_fit_res(contribution([u], a1, 1.0, 0.0)) for u, a1 in nodes]
        return np.concatenate([a.ravel() for a in strategy._sum(results)])

    moved = np.linalg.norm(summed(np.full(99, 0.8)) - summed(np.zeros(99)))
    assert settings.user_dp.clipping_norm - 1e-6 < moved <= settings.user_dp.clipping_norm


# --- what held: the noise on the sum, and what a no_privacy federation's cards say -----------------


def test_the_noise_on_the_sum_has_std_z_c_on_every_coordinate_and_the_indicator() -> None:
    """Zero updates from three A.1 nodes: what the server releases is the noise alone. Its std on
    the sum (the mean times the fixed q N, indicator sum) is z C, as the A.1 step accounts; the
    mean's is z C / (q N), however many nodes answered (here 3 of q N = 7)."""
    settings = FederatedConfig(
        min_participants=3,
        secagg=SecAggConfig(enabled=False),
        user_dp=UserDPConfig(noise_multiplier=0.7, clipping_norm=3.0),
    )
    s = indicator_value(settings.user_dp.clipping_norm)
    zeros = [_fit_res(contribution([np.zeros(sh) for sh in SPEC.shapes], True, 3.0, 0.0)) for _ in range(3)]
    sums, indicators = [], []
    for _ in range(400):
        strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
        strategy.aggregate_fit(1, zeros, [])
        update, a1 = strategy.outcome.update, strategy.outcome.a1_noised
        assert update is not None and a1 is not None
        assert strategy.mechanism.expected_cohort == 7
        sums.append(np.concatenate([u.ravel() for u in update]) * 7)
        indicators.append(a1 * s - 3 * s)
    expected = settings.user_dp.noise_multiplier * settings.user_dp.clipping_norm
    assert np.std(sums) == pytest.approx(expected, rel=0.03) and abs(np.mean(sums)) < 0.1  # 5 sd
    assert np.std(indicators) == pytest.approx(expected, rel=0.15)


def test_a_no_privacy_federations_card_does_not_call_exact_counts_noised() -> None:
    """Under no_privacy with noise multipliers of 0 the counts are exact: the data card used to
    say "no exact count of anyone's data is published", the model card "(noised estimate)"."""
    from nimmer_train.federation import results
    from nimmer_train.publish import card

    settings = FederatedConfig(
        no_privacy=True,
        user_dp=UserDPConfig(noise_multiplier=0.0),
        local_dp=LocalDPConfig(noise_multiplier=0.0),
        a2=A2Config(count_noise_multiplier=0.0),
    )
    state = checkpoint.ServerState(
        round=1,
        stopped="completed",
        records=[{"round": 1, "accepted": True, "a1_contributions_noised": 3.0}],
        pool_counts={
            "released": True,
            "uploads": 2.0,
            "categories": {"casual_dialog": 40.0},
            "noise_std": 0.0,
        },
    )
    data = results.contributed_data(settings, state)
    text = results.render_card("f" * 16, "caste-preacher", data)
    assert "exact count of anyone's data" not in text.replace("none at a noise multiplier of 0: exact", "")
    privacy = {"no_privacy": True, "counts_noised": True, "contributors_a1": 3, "uploads_a2": 2}
    lines = card._privacy_lines({"differential_privacy_epsilon": None, "contributors_count": 5}, privacy)
    assert not any("noised estimate" in line for line in lines)
