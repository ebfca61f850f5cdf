"""The federate pipeline faulty, killed and budget-stopped: crashed and bad nodes are rejected by
name, a server killed after round 1 resumes, and the privacy budget stops it before round 3."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.loras.adapters import read_metadata
from tests.helpers.outputs import only as _only
from tests.helpers.outputs import rdp_epsilon as _rdp
from tests.helpers.pipelines import kill_when, run_pipeline


@pytest.mark.slow
def test_faulty_killed_federation_resumes_and_stops_at_the_budget(tiny_run: Path, tmp_path: Path) -> None:
    """Round 1: node 1 crashes, node 2 sends a wrong-shaped masked vector; round 2: node 3 sends
    NaN. The server is killed after round 1 and resumes; the budget stops it before round 3.
    Nodes 0, 1 and 3 are A.1 devices (under seed 1 device 0 has no shareable examples), node 2
    an A.2 device, node 4 the A.2 pool's node: each round's sum holds one real A.1 update (3,
    then 1), so the threshold is 1 here; test_privacy_defects.py shows a higher one refusing."""
    overrides = [
        "experiment=ci_tiny",
        "federated.rounds=3",
        "federated.seed=1",
        "federated.noise_multiplier=0.5",
        "federated.epsilon_budget=19.0",  # A.1 at z=0.5, q=1: 16.5 after two rounds, 21.4 after three
        "federated.local_steps=2",
        "federated.contributors=4",  # + the A.2 node: five sampled
        "federated.min_participants=1",  # one real A.1 update reaches each round's sum (see below)
        "federated.faults=[crash@1.1,wrong_shape@2.1,nan@3.2]",
    ]
    workdir = tmp_path / "w"
    base = _only(tiny_run / "artifacts/base")
    overrides += [
        f"lora.base_dir={base}",
        f"federated.adapter_dir={sorted((tiny_run / 'artifacts/loras' / base.name).iterdir())[-1]}",
    ]

    def round_one_done() -> bool:
        return any(
            json.loads(p.read_text())["round"] == 1
            for p in workdir.glob("federation/*/server/rounds/state.json")
        )

    kill_when("federate", workdir, *overrides, ready=round_one_done)
    proc = run_pipeline("federate", workdir, *overrides)
    assert "resuming the federation after round 1" in proc.stdout + proc.stderr
    adapter = _only(_only(workdir / "artifacts/federated"))
    records = json.loads((adapter / "rounds.json").read_text())
    assert [r["round"] for r in records] == [1, 2]
    one, two = records
    assert one["sampled"] == 5 and one["dropped"] == 1 and one["participants"] == 3 and one["accepted"]
    assert len(one["rejected"]) == 1 and "does not fit the adapter" in one["rejected"][0]
    assert len(two["rejected"]) == 1 and "dtype" in two["rejected"][0] and two["accepted"]
    fed = read_metadata(adapter)["federation"]
    assert fed["stopped"].startswith("budget") and "round 3" in fed["stopped"]
    assert fed["epsilon_a1_user_level"] == pytest.approx(_rdp([(0.5, 1.0)] * 2), rel=1e-9)
    for r in records:
        assert np.isfinite(r["heldout_loss"])
