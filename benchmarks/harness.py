"""What every benchmark shares: run it, stamp the result with the commit and the machine, keep it.

A benchmark module ``benchmarks/bench_<name>.py`` exposes ``run(smoke: bool = False) -> dict``
returning its figures (headline ratios under keys ending in ``_ratio``, a ``"goal"`` string) and
ends with ``main(run)``. :func:`main` parses ``--smoke``, times the run and:

- writes ``benchmarks/results/<name>.json`` atomically (smoke runs: ``results/smoke/<name>.json``,
  never compared or quoted) and appends the same record to ``results/history/<name>.jsonl``, from
  which the runner (``python -m benchmarks``) takes the previous run on the same machine;
- logs the run to MLflow, experiment ``nimmer-bench`` in the project's store (``mlflow.db`` and
  ``mlartifacts/`` at the repository root, as the pipelines use), tagged with commit, machine and
  smoke, the ratios and every numeric figure as metrics and the record as ``result.json``;
- prints the ratios and the figures.
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import platform
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path

from nimmer_train.artifacts import git_commit, write_json_atomic

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"
EXPERIMENT = "bench"  # with the tracking prefix "nimmer": the experiment nimmer-bench
RATIO = "_ratio"

Run = Callable[..., dict[str, object]]


class BenchmarkError(ValueError):
    """A benchmark returned figures that break the contract (see the module docstring)."""


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict[str, object]:
    """Cores, torch threads, CPU model and torch version; ``key`` names the machine for comparisons."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    info: dict[str, object] = {
        "cpu_model": cpu_model(),
        "cores": cores,
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python": platform.python_version(),
    }
    info["key"] = f"{info['cpu_model']} | {cores} cores | {info['torch_threads']} torch threads"
    return info


def check_figures(name: str, figures: object) -> dict[str, object]:
    """The figures as the contract wants them, or a BenchmarkError naming what is missing."""
    where = f"benchmarks/{name}.py run()"
    if not isinstance(figures, dict):
        raise BenchmarkError(f"{where} returned {type(figures).__name__}; return a dict of figures")
    if not isinstance(figures.get("goal"), str) or not figures["goal"]:
        raise BenchmarkError(f'{where}: add a "goal" string saying what the figures should reach')
    ratios = {k: v for k, v in figures.items() if k.endswith(RATIO)}
    if not ratios:
        raise BenchmarkError(f"{where}: no headline ratio; name at least one figure '<what>{RATIO}'")
    for key, value in ratios.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise BenchmarkError(f"{where}: {key} = {value!r}; a ratio must be a finite number")
    return figures


def load_average() -> float | None:
    """The 1-minute load average (how busy the machine was), None where the OS has none."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def record(
    name: str,
    figures: dict[str, object],
    smoke: bool,
    started: float,
    wall_s: float,
    load_before: float | None,
) -> dict:
    """The result as written: ratios first, then the goal, the figures and where they came from."""
    rest = {k: v for k, v in figures.items() if not k.endswith(RATIO) and k != "goal"}
    return {
        "benchmark": name,
        "ratios": {k: float(v) for k, v in figures.items() if k.endswith(RATIO)},
        "goal": figures["goal"],
        "figures": rest,
        "commit": git_commit(REPO),
        "machine": machine(),
        "smoke": smoke,
        "started_at": datetime.fromtimestamp(started, UTC).isoformat(timespec="seconds"),
        "wall_s": round(wall_s, 3),
        "load_average_1m": {"before": load_before, "after": load_average()},
        "run_id": uuid.uuid4().hex,
    }


def save(result: dict, results: Path) -> Path:
    """Write the result (atomically) and, unless smoke, append it to its history."""
    name = result["benchmark"]
    folder = results / "smoke" if result["smoke"] else results
    path = folder / f"{name}.json"
    write_json_atomic(path, result)
    if not result["smoke"]:
        history = results / "history" / f"{name}.jsonl"
        history.parent.mkdir(parents=True, exist_ok=True)
        with open(history, "a") as fh:
            fh.write(json.dumps(result, sort_keys=True, default=str) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
    return path


def history(results: Path, name: str) -> list[dict]:
    """Every kept full run of one benchmark, oldest first (unreadable lines are skipped)."""
    path = results / "history" / f"{name}.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
    return out


def numeric(obj: object, prefix: str = "") -> Iterator[tuple[str, float]]:
    """(dotted key, value) for every finite number in nested figures."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from numeric(value, f"{prefix}{key}.")
    elif isinstance(obj, int | float) and not isinstance(obj, bool) and math.isfinite(obj):
        yield prefix[:-1], float(obj)


def log_mlflow(result: dict, store: Path) -> str:
    """One MLflow run in nimmer-bench for this result; returns its id."""
    import mlflow

    from nimmer_train.config import TrackingConfig
    from nimmer_train.tracking import configure, experiment_id

    cfg = TrackingConfig(store=str(store), artifact_root=str(store.parent / "mlartifacts"))
    configure(cfg)
    mine = result["machine"]
    run_name = f"{result['benchmark']} · {result['commit'][:12]}{' · smoke' if result['smoke'] else ''}"
    with mlflow.start_run(experiment_id=experiment_id(cfg, EXPERIMENT), run_name=run_name) as run:
        mlflow.set_tags(
            {
                "benchmark": result["benchmark"],
                "git_commit": result["commit"],
                "mlflow.source.git.commit": result["commit"],
                "machine": mine["key"],
                "cpu_model": mine["cpu_model"],
                "cores": mine["cores"],
                "torch_threads": mine["torch_threads"],
                "torch_version": mine["torch_version"],
                "smoke": str(result["smoke"]).lower(),
                "goal": result["goal"][:5000],
            }
        )
        metrics = dict(numeric(result["ratios"]))
        metrics.update(numeric(result["figures"]))
        metrics["wall_s"] = result["wall_s"]
        metrics.update(numeric(result["load_average_1m"], "load_average_1m."))
        mlflow.log_metrics(metrics)
        mlflow.log_dict(result, "result.json")
        return run.info.run_id


def render(result: dict) -> str:
    lines = [f"{result['benchmark']}{' (smoke: not a measurement)' if result['smoke'] else ''}"]
    lines += [f"  {k} = {v:.4g}" for k, v in result["ratios"].items()]
    lines.append(f"  goal: {result['goal']}")
    lines.append("  figures: " + json.dumps(result["figures"], indent=2, default=str).replace("\n", "\n  "))
    lines.append(
        f"  commit {result['commit']}, {result['machine']['key']}, "
        f"torch {result['machine']['torch_version']}, {result['wall_s']:.1f} s, "
        f"load average {result['load_average_1m']['before']} -> {result['load_average_1m']['after']}"
    )
    return "\n".join(lines)


def measure(run: Run, smoke: bool, results: Path, mlflow_store: Path | None) -> dict:
    """Run one benchmark, check its figures, write and log the result, and return it."""
    name = Path(inspect.getfile(run)).stem
    started, load = time.time(), load_average()
    clock = time.perf_counter()
    figures = check_figures(name, run(smoke=smoke))
    result = record(name, figures, smoke, started, time.perf_counter() - clock, load)
    path = save(result, results)
    print(render(result))
    print(f"  -> {path}")
    if mlflow_store is not None:
        print(f"  MLflow run {log_mlflow(result, mlflow_store)} in nimmer-{EXPERIMENT} ({mlflow_store})")
    return result


def main(run: Run, argv: list[str] | None = None) -> None:
    """The command line of one benchmark: ``python -m benchmarks.bench_<name> [--smoke]``."""
    parser = argparse.ArgumentParser(description=(inspect.getmodule(run).__doc__ or "").split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds; figures not quoted")
    parser.add_argument("--results-dir", type=Path, default=RESULTS, help="where results are kept")
    parser.add_argument("--mlflow-store", type=Path, default=REPO / "mlflow.db", help="MLflow SQLite store")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log to MLflow")
    args = parser.parse_args(argv)
    try:
        measure(run, args.smoke, args.results_dir, None if args.no_mlflow else args.mlflow_store)
    except BenchmarkError as exc:
        sys.exit(f"error: {exc}")
