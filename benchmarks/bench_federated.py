"""Federated round costs on Flower's simulation engine, tiny model, one process tree:

- bytes per client update (as measured on the wire: the SecAgg+ masked vector, and the raw
  float32 LoRA tensors) against the full model's float32 bytes, as ratios;
- round wall time at 4, 8 and 16 contributors, split into client compute (time inside the
  client's fit, summed over clients and divided by the number of parallel workers) and
  orchestration (the rest: SecAgg+ key exchange and unmasking, messaging, noise, evaluation).

The DP-SGD / non-DP step ratio is bench_dp.py. Writes benchmarks/results/bench_federated.json.
python -m benchmarks.bench_federated [--sizes 4 8 16] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation import stage
from nimmer_train.federation.app import client_app, server_app
from nimmer_train.federation.client import Node
from nimmer_train.federation.population import build_population
from nimmer_train.federation.rounds import make_setup
from nimmer_train.memory.embedding import SentenceEmbedder
from tests.helpers.flower_deployment import tiny_release

TIMINGS = "fit_seconds.jsonl"


def timing_mod(folder: Path) -> Any:
    """Innermost client mod: appends the seconds spent in fit to a file (actors are processes)."""

    def mod(msg: Any, ctxt: Any, call_next: Any) -> Any:
        started = time.perf_counter()
        out = call_next(msg, ctxt)
        with open(folder / TIMINGS, "a") as fh:
            fh.write(
                json.dumps({"round": int(msg.metadata.group_id), "s": time.perf_counter() - started}) + "\n"
            )
        return out

    return mod


def federation(n: int, rounds: int, base: Path, adapter: Path, folder: Path, embedder: Any) -> dict[str, Any]:
    settings = FederatedConfig(
        rounds=rounds,
        contributors=n,
        population=["A1_federated"],
        entries_per_player=40,
        min_participants=min(3, n),
        noise_multiplier=0.01,
        local_steps=4,
    )
    devices = build_population(folder / "devices", settings, embedder).devices
    nodes = [Node(base, adapter, device=d) for d in devices]
    state: dict[str, Any] = {}

    def done(_: Any, __: Any, ___: Any, final: Any) -> None:
        state["records"] = final.records

    sapp = server_app(
        lambda _: settings,
        lambda _, s: make_setup(base, adapter, folder / "rounds", s, None),
        done,
        lambda _: lambda record: None,
    )
    capp = client_app(
        lambda ctx: nodes[int(ctx.node_config["partition-id"])], extra_mods=[timing_mod(folder)]
    )
    started = time.perf_counter()
    stage._simulate(sapp, capp, n)
    total = time.perf_counter() - started
    fits = [json.loads(line) for line in (folder / TIMINGS).read_text().splitlines()]
    workers = min(n, min(os.cpu_count() or 1, 4))
    rows = []
    for record in state["records"]:
        compute = sum(f["s"] for f in fits if f["round"] == record["round"])
        critical = compute / workers
        rows.append(
            {
                "round": record["round"],
                "wall_s": record["seconds"],
                "client_compute_sum_s": compute,
                "client_compute_critical_path_s": critical,
                "orchestration_s": record["seconds"] - critical,
                "bytes_per_client_mean": sum(record["bytes_per_client"]) / len(record["bytes_per_client"]),
                "update_bytes_float32": record["update_bytes"],
            }
        )
    return {"contributors": n, "parallel_workers": workers, "simulation_total_s": total, "rounds": rows}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        base, adapter, params = tiny_release(Path(tmp))
        embedder = SentenceEmbedder()
        report: dict[str, Any] = {
            "model": "tiny",
            "base_parameters": params,
            "full_model_bytes_float32": 4 * params,
        }
        runs = [federation(n, args.rounds, base, adapter, Path(tmp) / f"n{n}", embedder) for n in args.sizes]
    last = runs[0]["rounds"][-1]
    report["update_bytes_float32"] = last["update_bytes_float32"]
    report["masked_update_bytes"] = last["bytes_per_client_mean"]
    report["ratio_lora_update_to_full_model"] = (
        last["update_bytes_float32"] / report["full_model_bytes_float32"]
    )
    report["ratio_masked_update_to_full_model"] = (
        last["bytes_per_client_mean"] / report["full_model_bytes_float32"]
    )
    report["runs"] = runs
    out = Path(__file__).parent / "results" / "bench_federated.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(
        f"update bytes: LoRA float32 {report['update_bytes_float32']:,} / full model {4 * params:,} = "
        f"{report['ratio_lora_update_to_full_model']:.4f}; masked on the wire "
        f"{last['bytes_per_client_mean']:,.0f} = {report['ratio_masked_update_to_full_model']:.4f} of it"
    )
    for run in runs:
        steady = run["rounds"][-1]  # the last round: actors warm
        print(
            f"{run['contributors']:>3} contributors: round {steady['wall_s']:.2f} s = client compute "
            f"{steady['client_compute_critical_path_s']:.2f} s "
            f"({steady['client_compute_sum_s']:.2f} s summed, {run['parallel_workers']} workers) "
            f"+ orchestration {steady['orchestration_s']:.2f} s"
        )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
