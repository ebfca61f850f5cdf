"""The federation as contributors run it: a real SuperLink and three SuperNodes as processes on
loopback over TLS (certificates made by the test), `flwr run federated` for two rounds, and a
bounded shutdown. Nodes: two A.1 devices and the server-operated A.2 client.

The deployment spends most of its time in Flower's 3-second polls, so tests/conftest.py's
``flower_two_rounds`` fixture starts :func:`two_rounds` in a background thread when the session
begins (only when this test is selected) and the test below joins it.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.population import build_population, deliver_uploads
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.memory.consent import PROFILE_FILE
from tests.helpers import REPO
from tests.helpers.flower_deployment import Background, deployment, tiny_release
from tests.helpers.memory import HashEmbedder


def two_rounds(work: Path) -> dict[str, Any]:
    base, adapter, _ = tiny_release(work / "release")
    population = build_population(
        work / "devices",
        FederatedConfig(
            contributors=4,
            population=["A1_federated", "A1_federated", "A2_anonymized", "A2_anonymized"],
            entries_per_player=40,
        ),
        HashEmbedder(),
    )
    pool = work / "server" / "a2_pool.sqlite"
    uploads = deliver_uploads(population, pool, k=2)
    release = f'base-dir="{base}" adapter-dir="{adapter}"'
    nodes = [f'{release} device="{device}"' for device in population.devices[:2]]
    nodes.append(f'{release} a2-pool="{pool}"')
    run_config = (
        f'{release} work-dir="{work / "server" / "rounds"}" out-dir="{work / "out"}" a2-pool="{pool}" '
        f'tracking-uri="sqlite:///{work / "mlflow.db"}" rounds=2 local-steps=2 noise-multiplier=0.01 '
        "min-participants=2"  # the two A.1 devices: the threshold counts real A.1 updates only
    )
    with deployment(work / "flower", nodes) as flower:
        flower.wait_nodes(3)
        started = time.monotonic()
        flower.run(REPO / "federated", run_config)
        run_seconds = time.monotonic() - started
        stopping = time.monotonic()
    planted = []
    for device in population.devices:
        profile = json.loads((device / PROFILE_FILE).read_text())
        planted += [profile["player_id"], profile["player_name"]]
    # the server's side: the SuperLink's log, the A.2 node's (server-operated), everything the
    # ServerApp wrote, the A.2 pool and the MLflow store; A.1 nodes' logs stay on their devices
    server_side = [
        work / "flower/logs/superlink.log",
        work / "flower/logs/supernode2.log",
        work / "mlflow.db",
    ]
    server_side += [p for folder in ("out", "server") for p in (work / folder).rglob("*") if p.is_file()]
    hits = [(str(p), t) for p in server_side for t in planted if t.lower().encode() in p.read_bytes().lower()]
    return {
        "planted": len(planted),
        "hits": hits,
        "uploads": uploads,
        "killed": flower.killed,
        "shutdown_seconds": time.monotonic() - stopping,
        "all_exited": all(p.poll() is not None for p in flower.processes),
        "run_seconds": run_seconds,
        "out": work / "out",
        "store": work / "mlflow.db",
    }


def start(work: Path) -> Background:
    job = Background(two_rounds, work)
    job.start()
    return job


@pytest.mark.slow
def test_superlink_and_three_supernodes_over_tls(flower_two_rounds: Background) -> None:
    result = flower_two_rounds.outcome(timeout=30 * 60)  # a hang guard, not a speed bound
    assert result["uploads"] == 2
    assert result["planted"] == 8 and result["hits"] == []
    assert result["killed"] == [] and result["shutdown_seconds"] < 30 and result["all_exited"]
    (published,) = result["out"].iterdir()
    records = json.loads((published / "rounds.json").read_text())
    assert [(r["round"], r["participants"], r["accepted"]) for r in records] == [(1, 3, True), (2, 3, True)]
    fed = read_metadata(published)["federation"]
    # counts are noised estimates: 2 A.1 devices at z = 0.01 round to 2; the A.2 uploads carry noise
    assert fed["counts_noised"] and fed["contributors_a1"] == 2 and fed["epsilon_a2_record_level"] > 0
    assert isinstance(fed["uploads_a2"], int) and fed["uploads_a2"] >= 0
    client = MlflowClient(tracking_uri=f"sqlite:///{result['store']}")
    (run,) = client.search_runs([client.get_experiment_by_name("nimmer-federate").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epsilon_a1_user_level")] == [1, 2]
    print(f"deployment: two rounds in {result['run_seconds']:.0f} s")
