"""A real Flower deployment on loopback for tests, started with the commands of
docs/federation-deployment.md: the SuperLink over TLS (certificates from `nimmer federation
certs`), nodes as processes (`flower-supernode` for the A.2 node, `nimmer contribute` for
devices), the `flwr` CLI with its own FLWR_HOME and the documented connection file, and a
bounded shutdown (SIGTERM to nodes then SuperLink and everything they started, SIGKILL after a
grace period).

Every ``timeout`` here is a hang guard sized for a loaded two-core machine, never a speed bound;
the shutdown grace is different: the deployment test asserts that shutdown is bounded."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
CONNECTION = "loopback"


def free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def flower_env(home: Path) -> dict[str, str]:
    """SuperLink and SuperNode start `flower-superexec` by name; nothing may call out."""
    home.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(home),
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_TELEMETRY_ENABLED": "0",
        "HF_HUB_OFFLINE": "1",
    }


def nimmer(*args: str, home: Path, check: bool = True) -> subprocess.CompletedProcess:
    """One `nimmer` command as a newcomer types it (the installed console script)."""
    proc = subprocess.run(
        [str(BIN / "nimmer"), *args], env=flower_env(home), capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode:
        raise AssertionError(f"nimmer {' '.join(args)} ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


@dataclass
class Deployment:
    work: Path
    ca: Path
    port: int
    processes: list[subprocess.Popen] = field(default_factory=list)
    killed: list[int] = field(default_factory=list)  # pids that ignored SIGTERM at shutdown
    nodes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        """A node process (a SuperNode, or `nimmer contribute`), logged to logs/<name>.log and
        stopped with the deployment."""
        proc = _start(command, self.work / f"home-{name}", self.work / "logs" / f"{name}.log")
        self.nodes[name] = proc
        return proc

    def log(self, name: str) -> str:
        return (self.work / "logs" / f"{name}.log").read_text()

    def cli(self, *args: str, timeout: float = 300) -> dict[str, Any]:
        proc = subprocess.run(
            [str(BIN / "flwr"), *args, "--format", "json"],
            env=flower_env(self.work / "home-cli"),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        out = proc.stdout
        try:
            return json.loads(out[out.index("{") :])
        except ValueError as exc:
            raise AssertionError(f"flwr {' '.join(args)} ({proc.returncode}):\n{out}\n{proc.stderr}") from exc

    def wait_nodes(self, n: int, timeout: float = 600, exactly: bool = False) -> None:
        """Until ``n`` nodes are online (``exactly``: no more either)."""
        deadline = time.monotonic() + timeout
        while True:
            nodes = self.cli("supernode", "list", CONNECTION).get("nodes", [])
            online = sum(node.get("status") == "online" for node in nodes)
            if online == n or (online > n and not exactly):
                return
            assert time.monotonic() < deadline, f"only {nodes} online after {timeout} s"
            time.sleep(0.5)

    def run(self, app: Path, run_config: str, timeout: float = 20 * 60) -> dict[str, Any]:
        """Submit the app, wait until the run finishes; the run's last status record. It waits in
        one `flwr log <id> --stream` (it ends with the run; logs/run-<id>.log), not by polling
        `flwr ls`: a CLI process a second, ~1.7 CPU-s each, took a core from the rest of the suite."""
        started = self.cli("run", str(app), CONNECTION, "--run-config", run_config)
        assert started.get("success"), started
        run_id = str(started["run-id"])
        deadline = time.monotonic() + timeout
        while True:
            self._follow(run_id, deadline)
            run = self.cli("ls", CONNECTION, "--run-id", run_id)["runs"][0]
            if run["status"].startswith("finished"):
                if run["status"] != "finished:completed":
                    log = subprocess.run(
                        [str(BIN / "flwr"), "log", run_id, CONNECTION, "--show"],
                        env=flower_env(self.work / "home-cli"),
                        capture_output=True,
                        text=True,
                        timeout=300,
                    )
                    raise AssertionError(f"run {run_id}: {run}\n{log.stdout[-6000:]}")
                return run
            assert time.monotonic() < deadline, f"run {run_id} still {run['status']} after {timeout} s"
            time.sleep(5)  # the stream ended before the run did (a dropped connection): follow again

    def _follow(self, run_id: str, deadline: float) -> None:
        """`flwr log <id> --stream` until the SuperLink ends the stream (the run finished) or
        ``deadline``; the log goes to logs/run-<id>.log."""
        log = self.work / "logs" / f"run-{run_id}.log"
        # past the deadline: the caller's check names the run and its status
        with open(log, "w") as out, suppress(subprocess.TimeoutExpired):
            subprocess.run(
                [str(BIN / "flwr"), "log", run_id, CONNECTION, "--stream"],
                env=flower_env(self.work / "home-cli"),
                stdout=out,
                stderr=subprocess.STDOUT,
                timeout=max(1.0, deadline - time.monotonic()),
            )


def _tree(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, stack = [], [pid]
    while stack:
        for child in children.get(stack.pop(), []):
            out.append(child)
            stack.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def stop(processes: list[subprocess.Popen], grace: float = 15) -> list[int]:
    """SIGTERM the processes and all they started; SIGKILL what is left after ``grace``.
    Returns the pids that had to be killed."""
    pids = [p.pid for p in processes] + [c for p in processes for c in _tree(p.pid)]
    for p in processes:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        for p in processes:
            p.poll()
        time.sleep(0.1)
    killed = [pid for pid in pids if _alive(pid)]
    for pid in killed:
        os.kill(pid, signal.SIGKILL)
    for p in processes:
        p.wait(timeout=10)
    return killed


@contextmanager
def deployment(work: Path, certs: Path) -> Iterator[Deployment]:
    """The documented SuperLink over TLS on loopback (``certs``: what `nimmer federation certs`
    made) and the `flwr` CLI's connection file; nodes join with :meth:`Deployment.start`."""
    ca = certs / "ca.crt"
    (port,) = free_ports(1)
    (work / "logs").mkdir(parents=True, exist_ok=True)
    d = Deployment(work, ca, port)
    superlink = [
        str(BIN / "flower-superlink"),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--ssl-ca-certfile", str(ca), "--ssl-certfile", str(certs / "server.crt")),
        *("--ssl-keyfile", str(certs / "server.key"), "--database", str(work / "superlink.db")),
        *("--isolation", "subprocess", "--disable-runtime-dependency-installation"),
    ]
    try:
        d.processes.append(_start(superlink, work / "home-superlink", work / "logs" / "superlink.log"))
        _wait_healthy(port, ca)
        home = work / "home-cli"
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "{d.address}"\nroot-certificates = "{ca}"\n'
        )
        yield d
    finally:
        nodes = list(d.nodes.values())
        d.killed = stop(nodes) + stop(d.processes)
        d.processes += nodes


def _start(command: list[str], home: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        command,
        env=flower_env(home),
        cwd=home,
        stdout=open(log, "w"),  # noqa: SIM115 - closed with the process
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_healthy(port: int, ca: Path, timeout: float = 600) -> None:
    context = ssl.create_default_context(cafile=str(ca))
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{port}/health", context=context, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"the SuperLink did not answer over TLS within {timeout} s"
        time.sleep(0.2)


def tiny_release(
    folder: Path,
    model_config: Any = None,
    lora_targets: tuple[str, ...] = ("q_proj", "v_proj"),
    prepare: Any = None,
) -> tuple[Path, Path, int]:
    """A tiny published base (tokenizer trained here) and a register adapter on it:
    (base dir, adapter dir, base parameter count). ``model_config`` (a ModelConfig; default the
    "tiny" preset) and ``lora_targets`` size it; ``prepare(model, tokenizer)``, if given, runs on
    the fresh base before it is saved (e.g. a short pretraining, for tests that need a real LM)."""
    from peft import LoraConfig, get_peft_model

    from nimmer_train.artifacts import write_json_atomic, write_manifest
    from nimmer_train.base.modeling import build_model, count_parameters
    from nimmer_train.base.tokenizer import train_bpe
    from nimmer_train.config import ModelConfig
    from nimmer_train.federation.client import example_text
    from nimmer_train.loras.adapters import METADATA, base_identity
    from nimmer_train.memory.synthetic import heldout_examples

    tokenizer = train_bpe([example_text(e) for e in heldout_examples(2000, seed=1)], 512, 256)
    model = build_model(
        model_config or ModelConfig(name="tiny"),
        len(tokenizer),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        0,
    )
    if prepare is not None:
        prepare(model, tokenizer)
    base = folder / "base" / "tiny-release"
    model.save_pretrained(base)
    tokenizer.save_pretrained(base)
    write_manifest(base, "base", "test", {})
    peft = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=list(lora_targets)))
    adapter = folder / "adapter"
    peft.save_pretrained(adapter)
    write_json_atomic(adapter / METADATA, {"register": "caste-preacher", "base": base_identity(base)})
    write_manifest(adapter, "register_adapter", "test", {})
    return base, adapter, count_parameters(model)
