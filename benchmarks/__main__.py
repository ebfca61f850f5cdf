"""``make bench``: every benchmarks/bench_*.py, each in its own process, then the comparison.

    python -m benchmarks [--smoke] [--only bench_memory ...] [--tolerance 0.10]

One failing benchmark does not stop the others; the command exits 1 if any failed. After a full
run it prints each headline ratio beside the previous run's on the same machine (from
benchmarks/results/history/) and flags those that moved by more than the tolerance. A moved ratio
is reported, not failed: on a shared machine noise moves ratios too, so read the flag, rerun.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks import compare
from benchmarks.harness import REPO, RESULTS, history

HERE = Path(__file__).resolve().parent
ENV = {  # as the Makefile exports them, for a run outside make
    "HF_HUB_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "FLWR_TELEMETRY_ENABLED": "0",
    "FLWR_DISABLE_UPDATE_CHECK": "1",
}


@dataclass(frozen=True)
class Outcome:
    name: str
    returncode: int
    seconds: float


def discover(folder: Path = HERE) -> list[str]:
    """The benchmark modules' names (bench_*.py), sorted."""
    return sorted(p.stem for p in folder.glob("bench_*.py"))


def run_each(modules: list[str], options: list[str], env: dict[str, str] | None = None) -> list[Outcome]:
    """Run ``python -m <module> <options>`` for each module in turn, output streamed through."""
    child_env = {**ENV, **os.environ, **(env or {})}
    outcomes = []
    for module in modules:
        name = module.rsplit(".", 1)[-1]
        print(f"\n=== {name}", flush=True)
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", module, *options], cwd=REPO, env=child_env)
        outcomes.append(Outcome(name, proc.returncode, time.perf_counter() - start))
        status = "ok" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
        print(f"=== {name}: {status} in {outcomes[-1].seconds:.1f} s", flush=True)
    return outcomes


def comparison(outcomes: list[Outcome], results: Path, kept_before: dict[str, int], tolerance: float) -> str:
    """The table of this run's ratios against the previous run's on the same machine."""
    rows = []
    for outcome in outcomes:
        runs = history(results, outcome.name)
        current = runs[-1] if len(runs) > kept_before[outcome.name] and outcome.returncode == 0 else None
        before = compare.previous(runs, current) if current else None
        rows += compare.rows(outcome.name, current, before)
    failed = {o.name for o in outcomes if o.returncode != 0}
    return compare.table(rows, tolerance, failed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes; checks that each one runs")
    parser.add_argument("--only", nargs="+", metavar="NAME", help="some benchmarks, e.g. bench_memory")
    parser.add_argument("--tolerance", type=float, default=compare.TOLERANCE, help="relative move flagged")
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--mlflow-store", type=Path, default=REPO / "mlflow.db")
    parser.add_argument("--no-mlflow", action="store_true")
    args = parser.parse_args(argv)
    names = discover()
    unknown = sorted(set(args.only or []) - set(names))
    if unknown:
        parser.error(f"unknown benchmark {', '.join(unknown)}; there are: {', '.join(names)}")
    names = [n for n in names if n in set(args.only or names)]
    options = ["--results-dir", str(args.results_dir.resolve())]
    options += ["--no-mlflow"] if args.no_mlflow else ["--mlflow-store", str(args.mlflow_store.resolve())]
    options += ["--smoke"] if args.smoke else []
    kept_before = {n: len(history(args.results_dir, n)) for n in names}
    outcomes = run_each([f"benchmarks.{n}" for n in names], options)

    print("\n=== summary")
    for o in outcomes:
        print(f"{o.name:24s} {'ok' if o.returncode == 0 else 'FAILED':8s} {o.seconds:8.1f} s")
    if not args.smoke:
        print(f"\nratios beside the previous run on this machine (flagged: moved > {args.tolerance:.0%})")
        print(comparison(outcomes, args.results_dir, kept_before, args.tolerance))
    failed = [o.name for o in outcomes if o.returncode != 0]
    if failed:
        print(f"\n{len(failed)} of {len(outcomes)} benchmarks failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
