"""What the server releases from a round (strategy.NoisyMean, issue 20 and its review): nothing
below the threshold of real A.1 updates; noise from the OS's entropy, never numpy's global seed,
with std z C on the sum and on the A.1 indicator; every A.2 node's step accounted, and only the
configured step accepted (a rate of 2 crashed the accounting, a NaN hung it, a huge step count
stopped the federation for good); nodes Poisson-sampled at the accounted rate (not
max(int(q N), min_participants) from Python's global generator); a sum that one contribution moves
by at most C (plain FedAvg's float32 average moved it by more)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from nimmer_train.config.federated import FederatedConfig, SecAggConfig, UserDPConfig
from nimmer_train.federation import budget
from nimmer_train.federation.mods import contribution
from nimmer_train.federation.strategy import NoisyMean, fit_config
from nimmer_train.federation.wire import A2_METRICS, A2_TAG, AdapterSpec, a2_claim_tag, indicator_value
from nimmer_train.privacy.accounting import Ledger

SPEC = AdapterSpec(("a", "b"), ((6, 4), (9,)))
KEY = b"0" * 64  # the A.2 pool's claim key (privacy.a2_pool.claim_key), as the server holds it


def _claim(strategy: NoisyMean, step: tuple, server_round: int = 1) -> dict:
    """The A.2 metrics of ``step``, tagged under KEY as the pool's A.2 node tags them."""
    tag = a2_claim_tag(KEY, server_round, strategy.claim_nonce, tuple(step))
    return {**dict(zip(A2_METRICS, step, strict=True)), A2_TAG: tag}


def _fit_res(arrays: list[np.ndarray], metrics: dict | None = None) -> tuple[None, FitRes]:
    return None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics or {})


def _results(
    a1: int, others: int, settings: FederatedConfig, a2: list[tuple] = (), strategy: NoisyMean | None = None
) -> list[tuple]:
    """FitRes of ``a1`` real A.1 contributions, ``others`` empty ones (opt-out, A.2 devices), and
    one per A.2 node step in ``a2`` (tagged for ``strategy``), as the plain (non-SecAgg) workflow
    hands them over."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(a1 + others + len(a2)):
        update = [
            rng.normal(size=shape) if i < a1 or i >= a1 + others else np.zeros(shape) for shape in SPEC.shapes
        ]
        arrays = contribution(update, i < a1, settings.user_dp.clipping_norm, 0.0)
        metrics = {}
        if i >= a1 + others:
            assert strategy is not None
            metrics = _claim(strategy, a2[i - a1 - others])
        out.append((None, FitRes(Status(Code.OK, ""), ndarrays_to_parameters(arrays), 1, metrics)))
    return out


# --- the threshold ---------------------------------------------------------------------------


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


# --- the noise: where it comes from, how large it is -------------------------------------------


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


@pytest.mark.usefixtures("quiet")
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
    seeds = np.random.SeedSequence(5).spawn(400)  # seeded: 400 indicator draws make a 4-sigma check
    for seed in seeds:
        strategy = NoisyMean(
            settings, SPEC, fit_config(settings, SPEC), rng=lambda s=seed: np.random.default_rng(s)
        )
        strategy.aggregate_fit(1, zeros, [])
        update, a1 = strategy.outcome.update, strategy.outcome.a1_noised
        assert update is not None and a1 is not None
        assert strategy.mechanism.expected_cohort == 7
        sums.append(np.concatenate([u.ravel() for u in update]) * 7)
        indicators.append(a1 * s - 3 * s)
    expected = settings.user_dp.noise_multiplier * settings.user_dp.clipping_norm
    assert np.std(sums) == pytest.approx(expected, rel=0.03) and abs(np.mean(sums)) < 0.1  # 5 sd
    assert np.std(indicators) == pytest.approx(expected, rel=0.15)


# --- the A.2 steps: every one accounted, none but the configured one accepted ------------------


def test_every_a2_node_of_a_round_is_accounted() -> None:
    """Item 6: two A.2 nodes in one round: both DP-SGD runs reach the ledger (before, the last
    one's step overwrote the first's). Each claims the configured step, the only one the server
    accepts (below), tagged (tests/unit/federation/test_a2_step_claims.py)."""
    settings = FederatedConfig(min_participants=3, secagg=SecAggConfig(enabled=False))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC), a2_key=KEY)
    a2 = [budget.planned_a2(settings)] * 2
    strategy.aggregate_fit(1, _results(a1=3, others=1, settings=settings, a2=a2, strategy=strategy), [])
    assert strategy.outcome.a2_steps == a2


@pytest.mark.usefixtures("quiet")
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
    """Even tagged with the pool's key (a node without it is ignored: test_a2_step_claims.py)."""
    settings = FederatedConfig(min_participants=3, secagg=SecAggConfig(enabled=False))
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC), a2_key=KEY)
    forged = _fit_res(
        contribution([np.zeros(s) for s in SPEC.shapes], False, settings.user_dp.clipping_norm, 0.0),
        _claim(strategy, claim),
    )
    released, _ = strategy.aggregate_fit(1, [*_results(a1=3, others=0, settings=settings), forged], [])
    assert released is None and not strategy.outcome.accepted and strategy.outcome.a2_steps == []
    assert strategy.outcome.reason.startswith("aggregate rejected: an A.2 accounting step")
    # the A.2 node's own claim is the configured step, and it is accounted
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC), a2_key=KEY)
    honest = _fit_res(parameters_of(forged), _claim(strategy, budget.planned_a2(settings)))
    strategy.aggregate_fit(1, [*_results(a1=3, others=0, settings=settings), honest], [])
    assert strategy.outcome.accepted and strategy.outcome.a2_steps == [budget.planned_a2(settings)]
    assert Ledger(settings.delta).after(None, strategy.outcome.a2_steps)["a2_record_level"] > 0


def parameters_of(res: tuple[None, FitRes]) -> list[np.ndarray]:
    return parameters_to_ndarrays(res[1].parameters)


# --- which nodes a round takes -----------------------------------------------------------------


class _Proxy(ClientProxy):
    get_properties = get_parameters = fit = evaluate = reconnect = None  # type: ignore[assignment]


@pytest.mark.usefixtures("quiet")
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


# --- the released sum's sensitivity -------------------------------------------------------------


@pytest.mark.usefixtures("quiet")
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
