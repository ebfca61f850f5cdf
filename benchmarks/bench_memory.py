"""Player memory speed, measured in one process on this machine:

- write throughput (entries per second, all-MiniLM-L6-v2 embedding included), one entry per
  write and in batches of 64;
- retrieval latency p50 / p95 at 10k and 100k entries for one player (384-dim vectors; the
  stores are filled with generated unit vectors), search + re-rank + access update, and the
  query embedding on its own. Goal: retrieval p95 <= 20 ms at 100k entries;
- prompt-assembly latency (the four-layer knowledge stack for one turn) at 10k entries.

Writes benchmarks/results/bench_memory.json.  python -m benchmarks.bench_memory
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.memory.entries import DATA_CATEGORIES, MEMORY_CLASSES
from nimmer_train.memory.knowledge import Canon, add_canon, assemble, propagate, set_districts
from nimmer_train.memory.player_memory import Mode, PlayerMemory


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def fill(memory: PlayerMemory, n: int, rng: np.random.Generator) -> None:
    """``n`` generated entries with random unit vectors, in batches of 5000."""
    for start in range(0, n, 5000):
        size = min(5000, n - start)
        vectors = rng.normal(size=(size, 384)).astype(np.float32)
        vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
        items = [
            {
                "text": f"generated memory {start + i}",
                "speaker": "npc",
                "memory_class": MEMORY_CLASSES[(start + i) % 4],
                "data_category": DATA_CATEGORIES[(start + i) % 6],
                "importance": float(rng.random()),
            }
            for i in range(size)
        ]
        memory.write_many(items, vectors=vectors)


def assembly_latency(memory: PlayerMemory) -> dict[str, float]:
    """The four-layer knowledge stack for one turn (query already embedded), 20 canon rows."""
    set_districts(memory, [("core", "ring"), ("ring", "wall")])
    add_canon(
        memory,
        [
            Canon(
                f"c{j}",
                f"Proclamation {j} about the curfew bell.",
                "world" if j % 2 else "district",
                "core",
                "normal",
                1,
                None,
                j,
            )
            for j in range(20)
        ],
    )
    propagate(memory, 100)
    budgets = {"world": 120, "district": 80, "primary": 300, "clasp": 200}
    queries = memory.embedder.embed([f"what happened at the gate {i}" for i in range(30)])
    timings = []
    for query in queries:
        t = time.perf_counter()
        assemble(memory, "ring", query, Mode.REALWORLD, budgets)
        timings.append(time.perf_counter() - t)
    return percentiles(timings[5:])


def main() -> None:
    embedder = SentenceEmbedder()
    rng = np.random.default_rng(0)
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        memory = PlayerMemory(Path(tmp) / "writes", embedder)
        lines = [f"The warden at gate {i} said the ration line moved again." for i in range(200)]
        start = time.perf_counter()
        for line in lines:
            memory.write(line, "npc", "working", "casual_dialog")
        single = len(lines) / (time.perf_counter() - start)
        start = time.perf_counter()
        for i in range(0, len(lines), 64):
            memory.write_many(
                [
                    {"text": t, "speaker": "npc", "memory_class": "working", "data_category": "casual_dialog"}
                    for t in lines[i : i + 64]
                ]
            )
        batched = len(lines) / (time.perf_counter() - start)
        report["write_entries_per_s"] = {"one_per_write": single, "batches_of_64": batched}

        queries = [f"where did the ration line go {i}" for i in range(50)]
        timings = []
        for q in queries:
            t = time.perf_counter()
            embedder.embed([q])
            timings.append(time.perf_counter() - t)
        report["query_embedding"] = percentiles(timings)

        for n in (10_000, 100_000):
            memory = PlayerMemory(Path(tmp) / f"p{n}", embedder)
            fill(memory, n, rng)
            probes = rng.normal(size=(120, 384)).astype(np.float32)
            probes /= np.linalg.norm(probes, axis=1, keepdims=True)
            memory.retrieve(probes[0], k=8)  # loads the in-memory index once per session
            timings = []
            for probe in probes[20:]:
                t = time.perf_counter()
                memory.retrieve(probe, k=8, categories=["casual_dialog", "memorial_archive", "dream_content"])
                timings.append(time.perf_counter() - t)
            report[f"retrieval_{n}"] = percentiles(timings)
            if n == 10_000:
                report["prompt_assembly_10000"] = assembly_latency(memory)
            memory.close()
    out = Path(__file__).parent / "results" / "bench_memory.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    w = report["write_entries_per_s"]
    print(
        f"writes: {w['one_per_write']:.0f} entries/s one at a time, "
        f"{w['batches_of_64']:.0f}/s in batches of 64"
    )
    print(f"query embedding: p50 {report['query_embedding']['p50_ms']:.1f} ms")
    for n in (10_000, 100_000):
        r = report[f"retrieval_{n}"]
        print(f"retrieval at {n:>7} entries: p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms")
    assembly = report["prompt_assembly_10000"]
    print(
        f"prompt assembly at 10000 entries (query already embedded): "
        f"p50 {assembly['p50_ms']:.1f} ms, p95 {assembly['p95_ms']:.1f} ms"
    )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
