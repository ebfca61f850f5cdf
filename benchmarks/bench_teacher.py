"""Requests per second of the openai_compatible teacher against a loopback server with a fixed
50 ms latency, at concurrency 1, 8 and 32, all in one process (the cache is bypassed).

With real concurrency, throughput grows with the number of requests in flight: the ideal is
concurrency / 0.05 s. Writes benchmarks/results/bench_teacher.json.

    make bench            (or: python -m benchmarks.bench_teacher --requests 256)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from nimmer_train.config import TeacherConfig
from nimmer_train.synth.teacher import make_teacher
from nimmer_train.synth.teacher.runner import run_requests
from nimmer_train.voice.composition import expand
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.compose import composition
from tests.helpers.llm_server import serve

LATENCY_S = 0.05


class NoCache:
    """Stands in for ResponseCache so every request goes to the server."""

    def get(self, *args: object) -> None:
        return None

    def put(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    args = parser.parse_args()
    requests = expand(composition(), load_catalogue())[: args.requests]
    report: dict[str, dict[str, float]] = {}
    with serve(latency_s=LATENCY_S) as server, tempfile.TemporaryDirectory() as tmp:
        for concurrency in (1, 8, 32):
            n = min(len(requests), 64 if concurrency == 1 else len(requests))
            cfg = TeacherConfig(
                backend="openai_compatible",
                model="bench",
                base_url=f"{server.url}/v1",
                concurrency=concurrency,
                cache=str(Path(tmp) / "unused.sqlite"),
            )
            teacher = make_teacher(cfg)
            before = server.total
            start = time.perf_counter()
            replies = [reply for _, reply, _ in run_requests(requests[:n], teacher, NoCache())]
            elapsed = time.perf_counter() - start
            assert all(r.error is None for r in replies) and server.total - before == n
            report[str(concurrency)] = {
                "requests": n,
                "seconds": elapsed,
                "requests_per_s": n / elapsed,
                "ideal_requests_per_s": concurrency / LATENCY_S,
            }
    base = report["1"]["requests_per_s"]
    for concurrency, row in report.items():
        row["speedup_vs_1"] = row["requests_per_s"] / base
        print(
            f"concurrency {concurrency:>2}: {row['requests_per_s']:7.1f} req/s "
            f"(ideal {row['ideal_requests_per_s']:.0f}; x{row['speedup_vs_1']:.1f} vs concurrency 1)"
        )
    out = Path(__file__).parent / "results" / "bench_teacher.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"latency_s": LATENCY_S, "results": report}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
