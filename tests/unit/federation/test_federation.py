"""Federated rounds: the Flower app on the simulation engine (run_all's federation on ci_tiny),
accounting checked against Opacus's accountant, planted identifiers searched for in everything
the server side wrote, and the update checks. The faulty, killed and budget-stopped federate
pipeline is in tests/e2e/test_federate_pipeline.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.artifacts import verify_manifest
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.client import DEVICE_ACCOUNTANT, device_examples
from nimmer_train.federation.population import build_population
from nimmer_train.federation.wire import AdapterSpec, check_update
from nimmer_train.loras.adapters import load_adapter, read_metadata
from nimmer_train.memory.consent import PROFILE_FILE
from nimmer_train.memory.embedding import NoEmbedder
from nimmer_train.privacy.a2_pool import pool_summary
from tests.helpers.outputs import only as _only
from tests.helpers.outputs import rdp_epsilon as _rdp


def _federation(workdir: Path) -> tuple[Path, Path]:
    """(published adapter, federation folder with devices/ and server/) of the one federation."""
    adapter = _only(_only(workdir / "artifacts/federated"))
    return adapter, _only(workdir / "federation")


def test_update_checks_name_what_is_wrong() -> None:
    spec = AdapterSpec(("a", "b"), ((2, 3), (4,)))
    good = [np.zeros((2, 3), np.float32), np.ones(4, np.float32)]
    assert check_update(good, spec) is None
    assert "tensors" in check_update(good[:1], spec)
    assert "shape" in check_update([np.zeros((3, 2), np.float32), good[1]], spec)
    assert "dtype" in check_update([good[0].astype(np.float64), good[1]], spec)
    assert "NaN" in check_update([good[0], np.array([1, np.inf, 0, 0], np.float32)], spec)


def test_federation_improves_the_adapter_and_accounts_privacy(tiny_run: Path) -> None:
    adapter, federation = _federation(tiny_run)
    assert verify_manifest(adapter) == []
    meta = read_metadata(adapter)
    fed = meta["federation"]
    # the exact node counts: in the server's private checkpoint only (rounds.json has none)
    records = json.loads((federation / "server/rounds/state.json").read_text())["records"]
    assert not {"participants", "sampled"} & set(json.loads((adapter / "rounds.json").read_text())[0])
    assert [r["round"] for r in records] == [1, 2] and all(r["accepted"] for r in records)
    assert fed["heldout_loss_after"] < fed["heldout_loss_before"]
    # only the LoRA tensors (+ the A.1 indicator) cross the wire, masked: 8 bytes per coordinate
    for r in records:
        # seven nodes sampled (q = 1); the opt-out and A.2 devices refuse (issue 23): they drop out,
        # the three A.1 devices and the A.2 pool's node answer; the denominator stays q N = 7
        assert r["sampled"] == 7 and r["dropped"] == 3 and r["expected_cohort"] == 7
        assert len(r["bytes_per_client"]) == r["participants"] == 4
        coordinates = r["update_bytes"] // 4
        assert all(8 * coordinates <= b <= 8 * coordinates + 4096 for b in r["bytes_per_client"])
        # no exact count of anyone's data: the A.1 count is the mechanism's noised one (std 2z = 0.02)
        assert not {"examples_a1", "examples_a2", "examples", "contributors"} & set(r)
        assert r["a1_contributions_noised"] == pytest.approx(3, abs=0.2)
    # reported epsilons equal Opacus's accountant fed the same mechanisms: A.1 once per round; A.2
    # the pool node's DP-SGD (6 steps a round) and the noised release of the pool's counts
    assert fed["epsilon_a1_user_level"] == pytest.approx(_rdp([(0.01, 1.0)] * 2), rel=1e-9)
    # the A.2 rate is the public batch_size / max_examples = 16 / 256, whatever the pool's size
    pool = pool_summary(federation / "server" / "a2_pool.sqlite", 2)
    assert fed["epsilon_a2_record_level"] == pytest.approx(
        _rdp([(1.0, 1 / 16)] * 12 + [(5.0, 1.0)]), rel=1e-9
    )
    # the privacy report: the A.1 mechanism in full (fixed denominator q N = 7 nodes) and the audit
    mechanism = fed["a1_mechanism"]
    assert mechanism["population"] == 7 and mechanism["expected_cohort"] == 7 and mechanism["rounds"] == 2
    assert mechanism["accountant"] == "opacus.rdp" and mechanism["sampling"] == "poisson"
    audit = fed["audit"]
    assert 0 <= audit["audit_epsilon_lower_bound"] <= audit["theoretical_epsilon"]
    assert audit["theoretical_epsilon"] == pytest.approx(fed["epsilon_a1_user_level"], rel=1e-9)
    # counts are noised estimates: A.1 from the per-round noised counts, A.2 uploads std 5 * sqrt(2)
    assert fed["counts_noised"] and fed["contributors_a1"] == 3
    assert isinstance(fed["uploads_a2"], int) and fed["uploads_a2"] >= 0
    state = json.loads((federation / "server/rounds/state.json").read_text())
    assert "contributors" not in state and state["pool_counts"]["released"]
    assert state["pool_counts"]["uploads"] != pool["uploads"]  # noised (a float that equals 2 only by chance)
    data = json.loads((adapter / "contributed_data.json").read_text())
    assert "examples_per_round" not in json.dumps(data)
    assert set(data["tiers"]["A2_anonymized"]["data_categories_noised"]) >= set(data["eligible_categories"])
    card = (adapter / "data_card.md").read_text()
    assert "A1_federated" in card and f"{fed['epsilon_a2_record_level']:.3f}" in card
    assert "Noised figures" in card and "noised pool counts" in card
    # the register-LoRA format: loads on its base with the adapter loader
    model = load_adapter(tiny_run / "artifacts/base" / meta["base"]["label"], adapter)
    assert meta["register"] in model.peft_config


def test_planted_player_ids_never_reach_the_server_side(tiny_run: Path) -> None:
    _, federation = _federation(tiny_run)
    devices = federation / "devices"
    planted = []
    for profile in devices.glob(f"*/{PROFILE_FILE}"):
        data = json.loads(profile.read_text())
        planted += [data["player_id"].encode(), data["player_name"].encode()]
    assert len(planted) == 12
    device_bytes = b"".join(p.read_bytes() for p in devices.rglob("*") if p.is_file())
    assert all(token in device_bytes for token in planted)  # the search can find them
    server_files = [p for p in tiny_run.rglob("*") if p.is_file() and devices not in p.parents]
    assert any(p.name == "run_all.log" for p in server_files)
    assert any(p.name == "a2_pool.sqlite" for p in server_files)
    hits = [
        (str(p.relative_to(tiny_run)), token.decode())
        for p in server_files
        for token in planted
        if token in p.read_bytes() or token.lower() in p.read_bytes().lower()
    ]
    assert hits == []


def test_opted_out_devices_share_nothing(tiny_run: Path) -> None:
    _, federation = _federation(tiny_run)
    population = build_population(federation / "devices", FederatedConfig(), NoEmbedder())  # ci_tiny's
    assert population.built() == list(range(6))  # q = 1: every device was sampled, hence built
    for i, tier in enumerate(population.tiers):
        name = population.path(i).name
        texts, contributor = device_examples(federation / "devices" / name)
        if tier == "A1_federated":
            assert contributor and all("[player]" in t or ":" in t for t in texts)
            if texts:  # the device's own accountant carried its DP-SGD steps across both rounds
                history = json.loads((federation / "devices" / name / DEVICE_ACCOUNTANT).read_text())[
                    "history"
                ]
                assert sum(steps for _, _, steps in history) == 2 * 6
        else:  # opt_out and A2 players share nothing through A.1 and have no A.1 id
            assert texts == [] and contributor is None
