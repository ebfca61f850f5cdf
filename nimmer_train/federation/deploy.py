"""The deployed app's glue: settings and places from Flower's run config (server) and node
config (SuperNode), publishing to ``out-dir``, metrics to MLflow when ``tracking-uri`` is set
(one run per ``flwr run``, tagged with the register, version and federation id, its run config
as params, ended FINISHED, FAILED or KILLED), and the ServerApp's last log lines (``flwr log``):
the rounds released, both epsilons labelled, the output folder.

Run config (``flwr run federated <connection> --run-config '...'``): every field of
:class:`FederatedConfig` with dashes, a group's as ``group.key`` (``user-dp.noise-multiplier``),
plus ``base-dir``, ``adapter-dir`` (the release the federation improves, as the server holds
it), ``work-dir`` (round checkpoints: a restarted run with the same work-dir resumes),
``out-dir`` (where the aggregated adapter is published), ``a2-pool`` (the A.2 intake, for
accounting) and ``tracking-uri``.

A contributor's side (``nimmer contribute``): :func:`run_supernode` starts a Flower SuperNode
against the operator's SuperLink over TLS, on a free local port, says in plain lines what it is
doing (and which address it keeps trying while the SuperLink does not answer), and stops it as
soon as the device's consent no longer lets it take part.
"""

from __future__ import annotations

import logging
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import Context

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.errors import NimmerError

if TYPE_CHECKING:
    from nimmer_train.federation.checkpoint import ServerState
    from nimmer_train.federation.rounds import Report, ServerSetup

log = logging.getLogger(__name__)


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
    if not settings.user_dp.population_size:
        raise NimmerError(
            "run config user-dp.population-size is 0: set it to the number of SuperNodes this federation "
            "draws from (every released mean is divided by user-dp.fraction-fit x user-dp.population-size)"
        )
    return settings


def setup_of(context: Context, settings: FederatedConfig) -> ServerSetup:
    from nimmer_train.federation.rounds import make_setup

    base, work = _place(context, "base-dir"), _place(context, "work-dir")
    assert base is not None and work is not None and settings.adapter_dir
    return make_setup(base, Path(settings.adapter_dir), work, settings, _place(context, "a2-pool", False))


def publish(context: Context, settings: FederatedConfig, setup: ServerSetup, state: ServerState) -> None:
    """The aggregated adapter to ``out-dir/<fp12>``; the ServerApp's log (``flwr log``) ends
    with the federation's epsilons, labelled, and the folder it went to."""
    from nimmer_train.federation.results import publish_federated

    out = published_to(context)
    assert settings.adapter_dir
    from nimmer_train.federation.rounds import federation_id

    ident = federation_id(setup.work)
    publish_federated(
        out,
        setup.model,
        Path(settings.adapter_dir),
        _fingerprint(context),
        settings,
        state,
        federation_id=ident,
    )
    for line in closing_lines(settings, state, setup.work, out):
        log.info("%s", line)


def closing_lines(settings: FederatedConfig, state: ServerState, work: Path, out: Path) -> list[str]:
    """The federation's last words: rounds released, both epsilons labelled (A.1 user-level is
    the guarantee a contributor gets; A.2 record-level covers the anonymised pool), where the
    adapter went."""
    from nimmer_train.federation.results import epsilons
    from nimmer_train.federation.rounds import federation_id

    eps = epsilons(settings, state)
    released = sum(1 for r in state.records if r.get("accepted"))
    label = lambda v: "none (no_privacy: no guarantee)" if v is None else f"{v:.4g}"  # noqa: E731
    return [
        f"federation {federation_id(work)}: {state.round} round(s) done, {released} released"
        + (f"; stopped: {state.stopped}" if state.stopped not in (None, "completed") else ""),
        f"epsilon A.1 user-level {label(eps['a1_user_level'])} at delta {settings.delta:g} "
        "(each contributor's guarantee)",
        "epsilon A.2 record-level 0: no A.2 pool was trained on in this federation"
        if eps["a2_record_level"] == 0
        else f"epsilon A.2 record-level {label(eps['a2_record_level'])} at delta {settings.delta:g} "
        "(each anonymised example of the A.2 pool)",
        f"the aggregated adapter is in {out}",
    ]


def _fingerprint(context: Context) -> str:
    from nimmer_train.artifacts import fingerprint

    return fingerprint(dict(context.run_config))


def published_to(context: Context) -> Path:
    """Where :func:`publish` writes: ``out-dir/<fp12>``, fp a fingerprint of the run config."""
    out = _place(context, "out-dir")
    assert out is not None
    return out / _fingerprint(context)[:12]


class RunReport:
    """Round records as metrics (at their round) of one MLflow run in experiment
    nimmer-federate, tagged with the stage, register, version and federation id and holding the
    run config as params; :meth:`end` closes it (the ServerApp ends it FINISHED, FAILED or
    KILLED: never left RUNNING)."""

    def __init__(self, client: Any, run_id: str) -> None:
        self.client, self.run_id = client, run_id
        self.records: list[dict[str, Any]] = []

    def __call__(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        step = int(record["round"])
        for key, value in record.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "round":
                self.client.log_metric(self.run_id, key, float(value), step=step)

    def end(self, status: str) -> None:
        """The round records as ``federation/rounds.json`` (as the simulated federate stage logs
        them), then the run's end state."""
        try:
            if self.records:
                self.client.log_dict(self.run_id, self.records, "federation/rounds.json")
        finally:
            self.client.set_terminated(self.run_id, status)


def report_of(context: Context) -> Report:
    """Round records to MLflow (a :class:`RunReport`) when tracking-uri is set; else nowhere."""
    uri = str(context.run_config.get("tracking-uri", "") or "")
    if not uri:
        return lambda record: None
    import mlflow
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    mlflow.set_tracking_uri(uri)
    experiment = mlflow.set_experiment("nimmer-federate").experiment_id
    tags = run_tags(context)
    name = f"federate {tags['register']} · {tags['version']} · federation {tags['federation_id'][:8]}"
    run_id = client.create_run(experiment, run_name=name, tags=tags).info.run_id
    params = {k: str(v)[:6000] for k, v in sorted(dict(context.run_config).items())}
    client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
    return RunReport(client, run_id)


def run_tags(context: Context) -> dict[str, str]:
    """The deployed federation's MLflow tags: what it is (stage federate, deployed with Flower),
    what it improves (register, version) and which ledger it spends (federation id)."""
    from nimmer_train.artifacts import read_manifest
    from nimmer_train.federation.checkpoint import STATE_FILE
    from nimmer_train.federation.rounds import federation_id
    from nimmer_train.loras.adapters import read_metadata

    base, adapter, work = (_place(context, k) for k in ("base-dir", "adapter-dir", "work-dir"))
    assert base is not None and adapter is not None and work is not None
    try:
        register = str(read_metadata(adapter).get("register", adapter.name))
    except (NimmerError, OSError, ValueError):
        register = adapter.name
    try:
        manifest = read_manifest(base)
    except (NimmerError, OSError, ValueError):
        manifest = {}
    ident = federation_id(work)
    return {
        "stage": "federate",
        "deployment": "flower",
        "register": register,
        "version": str(manifest.get("version_label") or base.name),
        "version_id": str(manifest.get("version_id", "")),
        "federation_id": ident,
        "flower_run_id": str(context.run_id),
        "resumed": str((work / STATE_FILE).exists()).lower(),
        "published_to": str(published_to(context)),
        "mlflow.note.content": (
            f"Deployed Flower federation {ident} improving {register} of "
            f"{manifest.get('version_label') or base.name}: held-out loss and both epsilons per round"
        ),
    }


def log_to_console() -> None:
    """The library's INFO lines (the round lines, the wait for nodes, the closing lines) through
    Flower's console handler, which a deployed ServerApp mirrors to ``flwr log``; without it they
    would go nowhere (no handler: Python prints warnings only)."""
    from flwr.common.logger import console_handler

    lib = logging.getLogger("nimmer_train")
    if console_handler not in lib.handlers:
        lib.addHandler(console_handler)
    lib.setLevel(logging.INFO)
    lib.propagate = False


ANSI = re.compile(r"\x1b\[[0-9;]*m")  # Flower colours its log levels


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, for the SuperNode's own local API."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def node_config(base: Path, adapter: Path, device: Path, federation: str) -> str:
    """A device SuperNode's ``--node-config`` (see ``client.Node.from_node_config``)."""
    values = {"base-dir": base, "adapter-dir": adapter, "device": device, "federation": federation}
    quoted = [str(v) for v in values.values() if "'" in str(v) or '"' in str(v)]
    if quoted:
        raise NimmerError(f"{quoted[0]!r} holds a quote, which a node config cannot carry; move or rename it")
    return " ".join(f"{k}='{v}'" for k, v in values.items())


@dataclass(frozen=True)
class SuperNode:
    """What ``nimmer contribute`` starts: the SuperLink it joins and how."""

    superlink: str  # host:port
    root_certificates: Path  # the operator's CA certificate
    node_config: str
    port: int  # the SuperNode's local API port (two SuperNodes on one machine need two)
    home: Path  # FLWR_HOME of this SuperNode
    host: str = "127.0.0.1"

    def command(self) -> list[str]:
        return [
            str(Path(sys.executable).parent / "flower-supernode"),
            *("--superlink", self.superlink, "--root-certificates", str(self.root_certificates)),
            *("--host", self.host, "--port", str(self.port), "--node-config", self.node_config),
        ]

    def env(self) -> dict[str, str]:
        """Flower finds flower-superexec on PATH; nothing calls out (telemetry, update checks)."""
        bin_dir = str(Path(sys.executable).parent)
        return {
            **os.environ,
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
            "FLWR_HOME": str(self.home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "HF_HUB_OFFLINE": "1",
        }


def run_supernode(
    node: SuperNode,
    still_takes_part: Callable[[], str | None],
    say: Callable[[str], None],
    retry_every: float = 20.0,
    check_every: float = 2.0,
) -> int:
    """Run the SuperNode until it exits or ``still_takes_part`` gives a reason to leave (then it
    is stopped; 0). Its log goes on with a ``supernode |`` prefix; while it has not reached the
    SuperLink, a line every ``retry_every`` seconds names the address it is trying."""
    node.home.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        node.command(),
        env=node.env(),
        cwd=node.home,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc, lines), daemon=True).start()
    previous = _leave_on_sigterm()
    connected, started, last_note, last_check = False, time.monotonic(), time.monotonic(), 0.0
    try:
        while True:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                line = ""
            if line is None:  # the SuperNode exited
                break
            if line:
                say(f"supernode | {ANSI.sub('', line).rstrip()}")
                if not connected and "SuperNode ID" in line:
                    connected = True
                    say(f"connected to the SuperLink at {node.superlink}; waiting for rounds (Ctrl-C leaves)")
            now = time.monotonic()
            if not connected and now - last_note >= retry_every:
                last_note = now
                say(
                    f"still trying to reach the SuperLink at {node.superlink} over TLS "
                    f"({now - started:.0f} s): check the address and port (Flower 1.42 serves on "
                    f"8000) and that {node.root_certificates} is the operator's CA"
                )
            if now - last_check >= check_every:
                last_check = now
                reason = still_takes_part()
                if reason is not None:
                    say(f"leaving the federation: {reason}")
                    _stop(proc)
                    return 0
    except KeyboardInterrupt:
        say("leaving the federation (interrupted)")
        _stop(proc)
        return 0
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return proc.wait()


def _leave_on_sigterm() -> Any:
    """SIGTERM (a service manager stopping ``nimmer contribute``) leaves like Ctrl-C: the
    SuperNode is stopped cleanly, never orphaned. Only the main thread may set handlers."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, interrupt)


def _pump(proc: subprocess.Popen, lines: queue.Queue) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.put(line)
    proc.wait()
    lines.put(None)


def _stop(proc: subprocess.Popen, grace: float = 20.0) -> None:
    """SIGTERM the SuperNode's process group (it deactivates itself at the SuperLink), SIGKILL
    after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
