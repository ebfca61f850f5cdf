"""tracking.uri switches from the embedded store to a real MLflow tracking server (loopback)."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.helpers.mlflow_server import server_env
from tests.helpers.pipelines import run_pipeline

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(tmp_path: Path) -> Iterator[str]:
    port = _free_port()
    store = tmp_path / "server"
    store.mkdir()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlflow",
            "server",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{store / 'mlflow.db'}",
            "--artifacts-destination",
            str(store / "artifacts"),
            "--workers",
            "1",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=server_env(),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600  # a hang guard: startup is slow on a loaded machine
    while True:
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None, "mlflow server exited"
            assert time.monotonic() < deadline, "mlflow server did not start in 600 s"
            time.sleep(0.5)
    yield url
    proc.terminate()
    proc.wait(timeout=300)


def test_runs_go_to_the_tracking_server(server: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    run_pipeline("ingest", work, f"tracking.uri={server}", "experiment=ci_tiny")
    assert not (work / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=server)
    exp = client.get_experiment_by_name("nimmer-ingest")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.data.metrics["works"] == 3
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"config.yaml", "manifest.json", "data_card"} <= artifacts
