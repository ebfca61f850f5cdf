"""The deployed federation's record (issue 42): its MLflow run is tagged (stage, register,
version, federation id), holds its run config as params and is ended (FINISHED after publishing,
FAILED on an error, KILLED when the run is stopped), never left RUNNING; and the ServerApp's log
(what `flwr log` shows) ends with both epsilons, labelled, and the folder the adapter went to.

The deployed ServerApp itself (``federated/server_app.py``'s: ``app.server_app`` over
``deploy``'s settings, setup, publishing and report) runs over an in-process grid of two
devices (tests/helpers/loopback_grid.py) against a real MLflow SQLite store; the stop and the
error come from the grid, as a SuperLink's would."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Context, RecordDict
from flwr.client import ClientApp, NumPyClient
from flwr.supercore.run import RunNotRunningException
from mlflow.tracking import MlflowClient

from nimmer_train.federation import deploy
from nimmer_train.federation.app import client_app, server_app
from nimmer_train.federation.rounds import federation_id
from nimmer_train.federation.wire import A1_UPDATE
from tests.helpers.loopback_grid import LoopbackGrid


class _Trainer(NumPyClient):
    """A device whose training moved the adapter a little (a real A.1 update)."""

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple:
        return [p + np.float32(1e-4) for p in parameters], 1, {A1_UPDATE: True}


class StoppedGrid(LoopbackGrid):
    """A grid whose run ends (``flwr stop``: RunNotRunningException) or breaks (an error) when
    the first round's messages go out."""

    def __init__(self, apps: dict[int, ClientApp], fault: BaseException) -> None:
        super().__init__(apps)
        self.fault = fault

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list:
        raise self.fault


def _run(release: tuple[Path, Path], work: Path, fault: BaseException | None = None) -> dict[str, Any]:
    run_config = {
        "base-dir": str(release[0]),
        "adapter-dir": str(release[1]),
        "work-dir": str(work / "rounds"),
        "out-dir": str(work / "out"),
        "tracking-uri": f"sqlite:///{work / 'mlflow.db'}",
        "min-participants": 2,
        "user-dp.population-size": 2,
        "rounds": 1,
        "heldout-examples": 4,
    }
    node = ClientApp(
        client_fn=lambda _ctx: _Trainer().to_client(), mods=list(client_app(lambda _c: None)._mods)
    )
    apps = {101: node, 102: node}
    grid = LoopbackGrid(apps) if fault is None else StoppedGrid(apps, fault)
    app = server_app(deploy.settings_of, deploy.setup_of, deploy.publish, deploy.report_of)
    context = Context(run_id=7, node_id=0, node_config={}, state=RecordDict(), run_config=run_config)
    with grid.serving():
        app(grid, context)
    return run_config


def _the_run(work: Path) -> Any:
    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("nimmer-federate").experiment_id])
    return client, run


@pytest.mark.usefixtures("quiet")
def test_a_finished_federation_is_tagged_parameterised_ended_and_its_log_ends_with_the_epsilons(
    release: tuple[Path, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="nimmer_train"):
        run_config = _run(release, tmp_path)
    client, run = _the_run(tmp_path)
    assert run.info.status == "FINISHED"
    ident = federation_id(tmp_path / "rounds")
    tags = run.data.tags
    assert (tags["stage"], tags["deployment"], tags["federation_id"]) == ("federate", "flower", ident)
    assert tags["register"] == "caste-preacher" and tags["version"] and tags["flower_run_id"] == "7"
    assert run.data.params == {k: str(v) for k, v in run_config.items()}
    rounds = json.loads(
        Path(client.download_artifacts(run.info.run_id, "federation/rounds.json")).read_text()
    )
    assert [r["round"] for r in rounds][-1] == 1  # the round records, as the simulated stage logs them
    (eps,) = client.get_metric_history(run.info.run_id, "epsilon_a1_user_level")
    assert eps.step == 1  # at its round
    out = Path(tags["published_to"])
    assert out.parent == tmp_path / "out" and out.is_dir()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("nimmer_train")]
    assert lines[-4].startswith(f"federation {ident}: 1 round(s) done, 1 released")
    assert lines[-3].startswith("epsilon A.1 user-level ") and "at delta 1e-05" in lines[-3]
    assert lines[-2].startswith("epsilon A.2 record-level ")
    assert lines[-1] == f"the aggregated adapter is in {out}"


@pytest.mark.usefixtures("quiet")
@pytest.mark.parametrize(
    ("fault", "status"),
    [(RunNotRunningException(), "KILLED"), (RuntimeError("the SuperLink went away"), "FAILED")],
)
def test_a_stopped_or_failed_federation_is_not_left_running(
    release: tuple[Path, Path], tmp_path: Path, fault: BaseException, status: str
) -> None:
    with pytest.raises(type(fault)):
        _run(release, tmp_path, fault)
    _, run = _the_run(tmp_path)
    assert run.info.status == status and run.data.tags["federation_id"] == federation_id(tmp_path / "rounds")
