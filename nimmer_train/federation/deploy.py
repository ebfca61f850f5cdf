"""The deployed app's glue: settings and places from Flower's run config (server) and node
config (SuperNode), publishing to ``out-dir``, metrics to MLflow when ``tracking-uri`` is set.

Run config (``flwr run federated <connection> --run-config '...'``): every field of
:class:`FederatedConfig` with dashes, plus ``base-dir``, ``adapter-dir`` (the release the
federation improves, as the server holds it), ``work-dir`` (round checkpoints: a restarted run
with the same work-dir resumes), ``out-dir`` (where the aggregated adapter is published),
``a2-pool`` (the A.2 intake, for accounting) and ``tracking-uri``.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.errors import NimmerError

if TYPE_CHECKING:
    from nimmer_train.federation.rounds import Report, ServerSetup, ServerState


def _place(context: Context, key: str, required: bool = True) -> Path | None:
    value = str(context.run_config.get(key, "") or "")
    if not value:
        if required:
            raise NimmerError(f"run config {key} is empty: pass --run-config '{key}=\"/absolute/path\"'")
        return None
    return Path(value)


def settings_of(context: Context) -> FederatedConfig:
    settings = FederatedConfig.from_run_config(dict(context.run_config))
    if not settings.adapter_dir:
        raise NimmerError(
            "run config adapter-dir is empty: name the register adapter this federation improves"
        )
    return settings


def setup_of(context: Context, settings: FederatedConfig) -> ServerSetup:
    from nimmer_train.federation.rounds import make_setup

    base, work = _place(context, "base-dir"), _place(context, "work-dir")
    assert base is not None and work is not None and settings.adapter_dir
    return make_setup(base, Path(settings.adapter_dir), work, settings, _place(context, "a2-pool", False))


def publish(context: Context, settings: FederatedConfig, setup: ServerSetup, state: ServerState) -> None:
    from nimmer_train.artifacts import fingerprint
    from nimmer_train.federation.results import publish_federated

    out = _place(context, "out-dir")
    assert out is not None and settings.adapter_dir
    fp = fingerprint(dict(context.run_config))
    publish_federated(out / fp[:12], setup.model, Path(settings.adapter_dir), fp, settings, state)


def report_of(context: Context) -> Report:
    """Round records to MLflow (a run in experiment nimmer-federate) when tracking-uri is set."""
    uri = str(context.run_config.get("tracking-uri", "") or "")
    if not uri:
        return lambda record: None
    import mlflow
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment("nimmer-federate").experiment_id
    run_id = client.create_run(experiment, run_name=f"flower run {context.run_id}").info.run_id

    def report(record: dict[str, Any]) -> None:
        step = int(record["round"])
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "round":
                client.log_metric(run_id, key, float(value), step=step)

    return report
