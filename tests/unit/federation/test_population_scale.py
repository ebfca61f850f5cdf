"""DP-FedAvg at population scale (issue 14, items 1-3): the Flower path on the simulation engine
with N = 1,000 virtual contributors (only the sampled ones are built), accounted as Opacus's RDP
accountant accounts the same steps, with Poisson cohorts of varying size and the fixed
denominator q N; and the one-process simulator, which on the same seeds (SecAgg+ off: the masked
sum is the same sum, quantised) selects the same cohorts and releases the same aggregate."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from opacus.accountants import RDPAccountant

from nimmer_train.config.federated import (
    AuditConfig,
    FederatedConfig,
    LocalDPConfig,
    LocalRecipeConfig,
    SecAggConfig,
    SimulationConfig,
    UserDPConfig,
)
from nimmer_train.federation import checkpoint
from nimmer_train.federation.local_training import load_trainable
from nimmer_train.federation.population import build_population
from nimmer_train.federation.simulator import Simulator
from nimmer_train.federation.stage import FederationPlan, run_federation
from nimmer_train.federation.wire import get_arrays
from nimmer_train.memory.consent import PROFILE_FILE
from tests.helpers.flower_deployment import tiny_release
from tests.helpers.memory import HashEmbedder

SEED = 3  # the seeded generator both paths draw their cohorts and noise from (production: OS entropy)
SETTINGS = FederatedConfig(
    rounds=3,
    delta=1e-6,
    min_participants=1,
    heldout_examples=8,
    secagg=SecAggConfig(enabled=False),
    user_dp=UserDPConfig(
        fraction_fit=0.01,  # expected cohort q N = 10
        noise_multiplier=0.8,
        clipping_norm=0.5,
    ),
    local=LocalRecipeConfig(steps=1, batch_size=8, lr=0.5, max_examples=16, max_length=32),
    local_dp=LocalDPConfig(
        on_devices=False,  # plain local SGD: the user-level mechanism alone (and comparable)
    ),
    audit=AuditConfig(
        canaries=0,  # the record-level canary audit has its own tests (tests/unit/privacy)
    ),
    simulation=SimulationConfig(
        contributors=999,  # + the A.2 node: N = 1,000 nodes
        population=["A1_federated"],
        entries_per_player=24,
        cpus=1,  # one Ray actor: the other test worker has the other core
    ),
)


def _opacus(steps: list[tuple[float, float]], delta: float) -> float:
    accountant = RDPAccountant()
    for noise, rate in steps:
        accountant.step(noise_multiplier=noise, sample_rate=rate)
    return accountant.get_epsilon(delta=delta)


@pytest.fixture(scope="module")
def flower(tmp_path_factory: pytest.TempPathFactory) -> tuple[FederationPlan, dict, list[dict]]:
    """One Flower federation of 1,000 nodes, its published metadata and its round records."""
    folder = tmp_path_factory.mktemp("population")
    base, adapter, _ = tiny_release(folder / "release")
    plan = FederationPlan(base, adapter, "caste-preacher", "f" * 64, folder / "out", folder / "federation")
    reported: list[dict] = []
    generator = np.random.default_rng(SEED)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        published = run_federation(
            plan, SETTINGS, reported.append, HashEmbedder(), serve_options={"rng": lambda: generator}
        )
    # the exact node counts (sampled, available) are in the server's private checkpoint only
    return plan, published, checkpoint.ServerState.load(plan.state_file.parent).records


def test_a_population_of_1000_is_accounted_as_opacus_accounts_it(flower: tuple) -> None:
    plan, published, records = flower
    fed = published["federation"]
    assert [r["round"] for r in records] == [1, 2, 3] and all(r["accepted"] for r in records)
    # epsilon: Opacus's RDP accountant fed one step (z, q) per released round
    assert fed["epsilon_a1_user_level"] == pytest.approx(_opacus([(0.8, 0.01)] * 3, 1e-6), rel=1e-9)
    for r in records:  # every record states the mechanism
        assert r["population"] == 1000 and r["available"] == 1000 and r["sample_rate"] == 0.01
        assert r["expected_cohort"] == pytest.approx(10) and r["noise_multiplier"] == 0.8
        assert r["clipping_norm"] == 0.5 and r["rounds"] == 3 and r["delta"] == 1e-6
        assert r["accountant"] == "opacus.rdp" and r["sampling"] == "poisson"
        assert r["noise_std"] == pytest.approx(0.8 * 0.5 / 10)  # z C / (q N), not / survivors
    # Poisson cohorts: their sizes vary (binomial(1000, 0.01)); only sampled devices were built
    sizes = [r["sampled"] for r in records]
    assert len(set(sizes)) > 1
    built = [p for p in (plan.folder / "devices").iterdir() if (p / ".made").exists()]
    assert 0 < len(built) <= sum(sizes) < 100
    # the planted-id search (issue 6): no built player's id or name in anything the server side wrote
    planted = []
    for device in built:
        profile = json.loads((device / PROFILE_FILE).read_text())
        planted += [profile["player_id"].encode(), profile["player_name"].encode()]
    server = [p for p in [*plan.out.rglob("*"), *(plan.folder / "server").rglob("*")] if p.is_file()]
    assert server and not [p for p in server for t in planted if t.lower() in p.read_bytes().lower()]


def test_the_simulator_selects_the_same_cohorts_and_releases_the_same_aggregate(
    flower: tuple, tmp_path: Path
) -> None:
    plan, _, records = flower
    population = build_population(plan.folder / "devices", SETTINGS, HashEmbedder())  # the same seeds
    simulator = Simulator.load(plan.base_dir, plan.adapter_dir, population, SETTINGS)
    built_before = {p.name for p in (plan.folder / "devices").iterdir()}
    state = simulator.run(SETTINGS, tmp_path / "sim", np.random.default_rng(SEED))
    assert [r["sampled"] for r in state.records] == [r["sampled"] for r in records]
    assert {p.name for p in (plan.folder / "devices").iterdir()} == built_before  # no other contributor
    flower_arrays = checkpoint.ServerState.load(plan.state_file.parent).arrays(plan.state_file.parent)
    with np.load(tmp_path / "sim" / "global-r0003.npz") as data:
        simulated = [data[f"arr_{i}"] for i in range(len(data.files))]
    assert flower_arrays is not None and len(simulated) == len(flower_arrays)
    start = get_arrays(load_trainable(plan.base_dir, plan.adapter_dir)[0])
    apart = max(float(np.abs(a - b).max()) for a, b in zip(simulated, flower_arrays, strict=True))
    moved = max(float(np.abs(a - b).max()) for a, b in zip(simulated, start, strict=True))
    assert apart <= 1e-5 < moved  # the same aggregates, and they did move the adapter
    for sim, real in zip(state.records, records, strict=True):
        assert sim["a1_contributions_noised"] == pytest.approx(real["a1_contributions_noised"], abs=1e-5)
        assert sim["epsilon_a1_user_level"] == pytest.approx(real["epsilon_a1_user_level"], rel=1e-12)
    # and the simulator resumes without re-running (or re-accounting) a released round
    again = simulator.run(SETTINGS, tmp_path / "sim", np.random.default_rng(SEED))
    assert again.records == state.records
    assert json.loads((tmp_path / "sim" / "simulation.json").read_text())["round"] == 3


@pytest.mark.parametrize("seed", [0, 3])
def test_the_heldout_set_is_no_contributors_stream(seed: int) -> None:
    """The server's held-out set was drawn from seed 10_000 + seed, which is contributor
    10_000 - 999 seed's own generator seed (``seed * 1000 + i``): at N = 10^5 and seed 0 the
    held-out set was contributor 10,000's entries under another name. It now has its own seed
    namespace (a spawn key), apart from every integer seed below 2**128."""
    from nimmer_train.federation.population import heldout_seed
    from nimmer_train.memory.synthetic import heldout_examples

    clash = 10_000 - 999 * seed  # the contributor whose seed the old held-out seed was
    old = np.random.SeedSequence(10_000 + seed).generate_state(4)
    assert (old == np.random.SeedSequence(seed * 1000 + clash).generate_state(4)).all()  # the defect
    new = heldout_seed(seed).generate_state(4)
    assert not (new == np.random.SeedSequence(seed * 1000 + clash).generate_state(4)).any()
    assert (new == np.random.SeedSequence(seed + 2**128).generate_state(4)).all()  # the nearest int
    assert heldout_examples(40, heldout_seed(seed)) == heldout_examples(40, heldout_seed(seed))
    assert heldout_examples(40, heldout_seed(seed)) != heldout_examples(40, 10_000 + seed)
