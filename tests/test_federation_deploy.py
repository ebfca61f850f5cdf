"""The federation as contributors run it: a real SuperLink and three SuperNodes as processes on
loopback over TLS (certificates made by the test), `flwr run federated` for two rounds, and a
bounded shutdown. Nodes: two A.1 devices and the server-operated A.2 client."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from nimmer_train.adapters import read_metadata
from nimmer_train.federation.population import build_population, deliver_uploads
from nimmer_train.federation.settings import FederatedConfig
from tests.conftest import REPO
from tests.flower_deployment import deployment
from tests.memory_helpers import HashEmbedder


@pytest.mark.slow
def test_superlink_and_three_supernodes_over_tls(tiny_run: Path, tmp_path: Path) -> None:
    base = next((tiny_run / "artifacts/base").iterdir())
    adapter = sorted((tiny_run / "artifacts/loras" / base.name).iterdir())[-1]
    population = build_population(
        tmp_path / "devices",
        FederatedConfig(
            contributors=4,
            population=["A1_federated", "A1_federated", "A2_anonymized", "A2_anonymized"],
            entries_per_player=40,
        ),
        HashEmbedder(),
    )
    pool = tmp_path / "server" / "a2_pool.sqlite"
    assert deliver_uploads(population, pool, k=2) == 2
    release = f'base-dir="{base}" adapter-dir="{adapter}"'
    nodes = [f'{release} device="{device}"' for device in population.devices[:2]] + [
        f'{release} a2-pool="{pool}"'
    ]
    out, store = tmp_path / "out", tmp_path / "mlflow.db"
    run_config = (
        f'{release} work-dir="{tmp_path / "server" / "rounds"}" out-dir="{out}" a2-pool="{pool}" '
        f'tracking-uri="sqlite:///{store}" rounds=2 local-steps=2 noise-multiplier=0.01'
    )
    with deployment(tmp_path / "flower", nodes) as flower:
        flower.wait_nodes(3)
        started = time.monotonic()
        flower.run(REPO / "federated", run_config)
        run_seconds = time.monotonic() - started
        stopping = time.monotonic()
    assert flower.killed == [] and time.monotonic() - stopping < 30  # all stopped on SIGTERM
    assert all(p.poll() is not None for p in flower.processes)
    (published,) = out.iterdir()
    records = json.loads((published / "rounds.json").read_text())
    assert [(r["round"], r["participants"], r["accepted"]) for r in records] == [(1, 3, True), (2, 3, True)]
    fed = read_metadata(published)["federation"]
    assert fed["contributors_a1"] == 2 and fed["uploads_a2"] == 2 and fed["epsilon_a2_record_level"] > 0
    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("nimmer-federate").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "epsilon_a1_user_level")] == [1, 2]
    print(f"deployment: two rounds in {run_seconds:.0f} s")
