"""A real ``mlflow server`` process on a free loopback port over an existing store, for the
length of a ``with`` block; headless Chromium's rendering of its UI: the DOM after the React app
ran (``--dump-dom``, what tests/e2e/test_mlflow_ui.py asserts on) and screenshots.

    python -m tests.helpers.mlflow_server WORKDIR OUT_DIR

serves WORKDIR's store (mlflow.db, mlartifacts/) and writes OUT_DIR/experiment.png and
OUT_DIR/registered_model.png. It needs Chromium (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

START_HANG_GUARD_S = 600  # startup is slow on a loaded machine; this only catches a hang
CHROMIUM = ("chromium", "chromium-browser")
# Chromium's virtual time (ms) for the React app to fetch and render, tried in turn until the page
# shows what is awaited: a larger budget only on a loaded machine (a hang guard, not a bound)
VIRTUAL_TIME_BUDGETS_MS = (20_000, 60_000, 180_000)
HEADLESS = ("--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars")  # CI runs as root


def runs_table_url(url: str, experiment_id: str) -> str:
    """An experiment's runs table, every run a row: MLflow 3.17 opens an experiment in its GenAI
    view unless ``workflowType=machine_learning``; sorted by name, nested runs are rows of their
    own rather than folded under their parent."""
    from nimmer_train.tracking import RUNS_TABLE

    return f"{url}/#/experiments/{experiment_id}/runs?{RUNS_TABLE}"


def server_env() -> dict[str, str]:
    """The environment of a test's ``mlflow server``: without MLflow's job runner, whose eight Huey
    consumer processes each import MLflow (about 25 CPU-seconds) for jobs no test asks for."""
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


@contextmanager
def mlflow_server(workdir: Path, log_file: Path) -> Iterator[str]:
    """Serve ``workdir``'s embedded store (the server's output goes to ``log_file``); yield the URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
        "--backend-store-uri", f"sqlite:///{workdir / 'mlflow.db'}",
        "--default-artifact-root", str(workdir / "mlartifacts"), "--workers", "1",
    ]  # fmt: skip
    log = open(log_file, "w")  # noqa: SIM115 (closed below)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_HANG_GUARD_S
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                assert proc.poll() is None, f"mlflow server exited; see {log_file}"
                assert time.monotonic() < deadline, f"mlflow server did not start in {START_HANG_GUARD_S} s"
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=300)
        log.close()


def chromium() -> str | None:
    """The headless-capable Chromium binary, if installed."""
    return next((found for name in CHROMIUM if (found := shutil.which(name))), None)


def dump_dom(url: str, budget_ms: int = VIRTUAL_TIME_BUDGETS_MS[0], height: int = 2400) -> str:
    """The DOM of ``url`` after its scripts ran for ``budget_ms`` of Chromium's virtual time."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("Chromium is not installed (Debian: apt-get install chromium)")
    size, budget = f"--window-size=1440,{height}", f"--virtual-time-budget={budget_ms}"
    proc = subprocess.run(
        [binary, *HEADLESS, size, budget, "--dump-dom", url],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc.stdout


def page_text(dom: str) -> str:
    """The text a reader sees in a dumped DOM: scripts and styles dropped, tags removed, entities
    decoded, whitespace collapsed."""
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom))).strip()


def rendered_text(url: str, ready: Callable[[str], bool]) -> str:
    """The page's text once ``ready(text)`` holds, with larger virtual-time budgets in turn; the
    last text when it never does (the caller's assertions then say what is missing)."""
    text = ""
    for budget in VIRTUAL_TIME_BUDGETS_MS:
        text = page_text(dump_dom(url, budget))
        if ready(text):
            break
    return text


def screenshot(url: str, out: Path, width: int = 1440, height: int = 900) -> Path:
    """A PNG of ``url`` after its scripts ran (the MLflow UI renders client-side)."""
    binary = chromium()
    if binary is None:
        raise RuntimeError("Chromium is not installed (Debian: apt-get install chromium)")
    out.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            binary, *HEADLESS, f"--window-size={width},{height}",
            f"--virtual-time-budget={VIRTUAL_TIME_BUDGETS_MS[0]}", f"--screenshot={out}", url,
        ],
        check=True, capture_output=True, timeout=300,
    )  # fmt: skip
    return out


def ui_screenshots(url: str, experiment_id: str, model: str, out: Path) -> list[Path]:
    """The experiment's runs table and a registered model's page."""
    return [
        screenshot(runs_table_url(url, experiment_id), out / "experiment.png"),
        screenshot(f"{url}/#/models/{model}", out / "registered_model.png"),
    ]


if __name__ == "__main__":
    import json

    work, target = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    target.mkdir(parents=True, exist_ok=True)
    with mlflow_server(work, target / "mlflow_server.log") as base:
        query = urllib.request.urlopen(
            f"{base}/api/2.0/mlflow/experiments/get-by-name?experiment_name=nimmer-run_all"
        )
        exp = json.load(query)["experiment"]["experiment_id"]
        for path in ui_screenshots(base, exp, "nimmerworld-base", target):
            print(path)
