"""Benchmarks that cannot rot: every benchmarks/bench_*.py (found on disk, so a new one is covered
the day it lands) runs in smoke mode in its own process and writes a well-formed result, and the
runner keeps going past a failing benchmark, compares a run with the previous one on the same
machine and logs to MLflow. Smoke figures are not checked: tiny runs on a shared machine. Marked
slow: a process per benchmark (the comparison logic itself is tests/unit/test_benchmarks.py)."""

from __future__ import annotations

import ast
import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from benchmarks.__main__ import Outcome, comparison, discover, run_each
from benchmarks.harness import history
from tests.helpers import REPO

pytestmark = pytest.mark.slow

HANG_GUARD_S = 1800  # a hung benchmark, never a bound on how slow the machine may be


def contract_problem(path: Path) -> str | None:
    """What keeps a benchmark module from the contract, read from its source (None: it follows it)."""
    tree = ast.parse(path.read_text())
    runs = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "run"]
    if not runs or [a.arg for a in runs[0].args.args] != ["smoke"]:
        return "it has no top-level `def run(smoke: bool = False) -> dict[str, object]`"
    if "main(run)" not in ast.unparse(tree.body[-1]):
        return "it does not end with `if __name__ == '__main__': ... main(run)` (benchmarks.harness)"
    return None


def check_result(result: dict, name: str, smoke: bool) -> None:
    assert result["benchmark"] == name and result["smoke"] is smoke
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert result["commit"].removesuffix("-dirty") == head.strip()
    machine = result["machine"]
    assert machine["cores"] >= 1 and machine["torch_threads"] >= 1 and machine["torch_version"]
    assert machine["cpu_model"] and machine["key"]
    assert result["ratios"] and all(k.endswith("_ratio") for k in result["ratios"])
    assert all(isinstance(v, float) and math.isfinite(v) for v in result["ratios"].values())
    assert isinstance(result["goal"], str) and result["goal"]
    assert isinstance(result["figures"], dict) and result["wall_s"] >= 0


@pytest.mark.parametrize("name", discover())
def test_every_benchmark_runs_in_smoke_mode_and_writes_a_well_formed_result(
    name: str, tmp_path: Path
) -> None:
    problem = contract_problem(REPO / "benchmarks" / f"{name}.py")
    assert problem is None, f"benchmarks/{name}.py breaks the benchmark contract: {problem}"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            f"benchmarks.{name}",
            "--smoke",
            "--results-dir",
            str(tmp_path),
            "--no-mlflow",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    assert proc.returncode == 0, f"{name} --smoke failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    check_result(json.loads((tmp_path / "smoke" / f"{name}.json").read_text()), name, smoke=True)
    assert not (tmp_path / "history").exists(), "smoke results are kept apart and never compared"


FAKE_OK = """
import os
from benchmarks.harness import main

def run(smoke: bool = False) -> dict[str, object]:
    return {"speed_ratio": float(os.environ["FAKE_RATIO"]), "goal": "ratio >= 1", "n": 3}

if __name__ == "__main__":
    main(run)
"""


def test_the_runner_survives_a_failing_benchmark_and_compares_with_the_previous_run(tmp_path: Path) -> None:
    package = tmp_path / "fakebench"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "bench_broken.py").write_text("raise RuntimeError('this benchmark is broken')\n")
    (package / "bench_fine.py").write_text(textwrap.dedent(FAKE_OK))
    results, store = tmp_path / "results", tmp_path / "mlflow.db"
    options = ["--results-dir", str(results), "--mlflow-store", str(store)]
    modules = ["fakebench.bench_broken", "fakebench.bench_fine"]
    env = {"PYTHONPATH": f"{tmp_path}:{REPO}"}

    first = run_each(modules, [*options, "--no-mlflow"], {**env, "FAKE_RATIO": "1.0"})
    assert [o.returncode != 0 for o in first] == [True, False]  # the broken one did not hide the other
    kept = {"bench_broken": 0, "bench_fine": 1}
    second = run_each(modules[1:], options, {**env, "FAKE_RATIO": "1.5"})
    check_result(json.loads((results / "bench_fine.json").read_text()), "bench_fine", smoke=False)
    assert [r["ratios"]["speed_ratio"] for r in history(results, "bench_fine")] == [1.0, 1.5]

    table = comparison([Outcome("bench_broken", 1, 0.1), *second], results, kept, tolerance=0.10)
    broken, fine = (line for line in table.splitlines()[2:])
    assert broken.startswith("bench_broken") and broken.endswith("FAILED")
    assert fine.split()[:4] == ["bench_fine", "speed_ratio", "1.5", "1"] and "+50.0%" in fine
    assert fine.endswith("MOVED > 10%")

    client = MlflowClient(tracking_uri=f"sqlite:///{store}")
    experiment = client.get_experiment_by_name("nimmer-bench")
    runs = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time ASC"])
    assert [r.data.metrics["speed_ratio"] for r in runs] == [1.5]
    tags = runs[0].data.tags
    assert tags["smoke"] == "false" and tags["benchmark"] == "bench_fine" and tags["machine"]
    assert tags["git_commit"] == json.loads((results / "bench_fine.json").read_text())["commit"]
