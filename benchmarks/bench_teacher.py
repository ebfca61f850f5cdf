"""Requests per second of the openai_compatible teacher against a loopback server with a fixed
50 ms latency, at concurrency 1, 8 and 32, all in one process (the cache is bypassed).

With real concurrency, throughput grows with the number of requests in flight: the ideal is
concurrency / 0.05 s; the headline ratios are requests/s over that ideal at concurrency 8 and 32.

    python -m benchmarks.bench_teacher [--smoke]      (all of them: make bench)
"""

from __future__ import annotations

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


def run(smoke: bool = False) -> dict[str, object]:
    """Requests/s at each concurrency, and each against the ideal concurrency / latency."""
    total = 24 if smoke else 256
    levels = (1, 8) if smoke else (1, 8, 32)
    requests = expand(composition(), load_catalogue())[:total]
    rows: dict[str, dict[str, float]] = {}
    with serve(latency_s=LATENCY_S) as server, tempfile.TemporaryDirectory() as tmp:
        for concurrency in levels:
            n = min(len(requests), (8 if smoke else 64) if concurrency == 1 else len(requests))
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
            if any(r.error is not None for r in replies) or server.total - before != n:
                raise RuntimeError(
                    f"concurrency {concurrency}: {n} requests sent, some failed or went astray"
                )
            rows[str(concurrency)] = {
                "requests": n,
                "seconds": elapsed,
                "requests_per_s": n / elapsed,
                "ideal_requests_per_s": concurrency / LATENCY_S,
            }
    for row in rows.values():
        row["speedup_vs_1"] = row["requests_per_s"] / rows["1"]["requests_per_s"]
    ratios = {
        f"concurrency_{c}_over_ideal_ratio": row["requests_per_s"] / row["ideal_requests_per_s"]
        for c, row in rows.items()
        if c != "1"
    }
    return {
        **ratios,
        "goal": "requests/s near the ideal concurrency / 50 ms at each concurrency (ratios toward 1.0)",
        "latency_s": LATENCY_S,
        "by_concurrency": rows,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
