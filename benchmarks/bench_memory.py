"""Player memory speed, measured in one process on this machine:

- write throughput (entries per second, all-MiniLM-L6-v2 embedding included), one entry per
  write and in batches of 64;
- retrieval latency p50 / p95 at 10k and 100k entries for one player (384-dim vectors; the
  stores are filled with generated unit vectors), search + re-rank + access update, and the
  query embedding on its own. Goal: retrieval p95 <= 20 ms at 100k entries;
- prompt-assembly latency (the four-layer knowledge stack for one turn) at 10k entries;
- the headline ratio: retrieval p50 over a bare numpy top-k scan of the same vectors at 100k.

The stores hold every category: clasp entries go to the clasp store through IN_BETWEEN writes,
the only way the store accepts them.  python -m benchmarks.bench_memory [--smoke]
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import numpy as np

from nimmer_train.memory.canon import Canon, add_canon, assemble, propagate, set_districts
from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.memory.entries import DATA_CATEGORIES, MEMORY_CLASSES
from nimmer_train.memory.player_memory import Mode, PlayerMemory

CATEGORIES = tuple(c for c in DATA_CATEGORIES if c != "clasp")


def percentiles(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p95_ms": float(np.percentile(ms, 95))}


def fill(memory: PlayerMemory, n: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` generated primary entries (every category but clasp) with random unit vectors, and
    ``n // 6`` clasp entries written in IN_BETWEEN mode to the clasp store, as the store requires,
    in batches of 5000. Returns the primary vectors (the numpy baseline scans the same ones)."""
    kept = []
    for store, count in (("primary", n), ("clasp", n // 6)):
        for start in range(0, count, 5000):
            size = min(5000, count - start)
            vectors = rng.normal(size=(size, 384)).astype(np.float32)
            vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
            items = [
                {
                    "text": f"generated {store} memory {start + i}",
                    "speaker": "npc",
                    "memory_class": MEMORY_CLASSES[(start + i) % 4],
                    "data_category": "clasp"
                    if store == "clasp"
                    else CATEGORIES[(start + i) % len(CATEGORIES)],
                    "importance": float(rng.random()),
                }
                for i in range(size)
            ]
            mode = Mode.IN_BETWEEN if store == "clasp" else Mode.REALWORLD
            memory.write_many(items, mode, vectors=vectors)
            if store == "primary":
                kept.append(vectors)
    return np.concatenate(kept)


def numpy_scan(matrix: np.ndarray, probe: np.ndarray, k: int) -> np.ndarray:
    """The bare baseline: exact cosine top-k over the same vectors, nothing else."""
    similarity = matrix @ probe
    top = np.argpartition(-similarity, k - 1)[:k]
    return top[np.argsort(-similarity[top])]


def assembly_latency(memory: PlayerMemory, turns: int) -> dict[str, float]:
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
    queries = memory.embedder.embed([f"what happened at the gate {i}" for i in range(turns)])
    timings = []
    for query in queries:
        t = time.perf_counter()
        assemble(memory, "ring", query, Mode.REALWORLD, budgets)
        timings.append(time.perf_counter() - t)
    return percentiles(timings[5:])


def run(smoke: bool = False) -> dict[str, object]:
    """Write throughput, retrieval and prompt-assembly latency; retrieval against a numpy scan."""
    writes, sizes, probes_n = (8, (200, 500), 26) if smoke else (200, (10_000, 100_000), 120)
    embedder = SentenceEmbedder()
    rng = np.random.default_rng(0)
    report: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        memory = PlayerMemory(Path(tmp) / "writes", embedder)
        lines = [f"The warden at gate {i} said the ration line moved again." for i in range(writes)]
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
        memory.close()
        report["write_entries_per_s"] = {"one_per_write": single, "batches_of_64": batched}

        timings = []
        for i in range(probes_n // 2):
            t = time.perf_counter()
            embedder.embed([f"where did the ration line go {i}"])
            timings.append(time.perf_counter() - t)
        report["query_embedding"] = percentiles(timings)

        for n in sizes:
            memory = PlayerMemory(Path(tmp) / f"p{n}", embedder)
            matrix = fill(memory, n, rng)
            probes = rng.normal(size=(probes_n, 384)).astype(np.float32)
            probes /= np.linalg.norm(probes, axis=1, keepdims=True)
            memory.retrieve(probes[0], k=8)  # loads the in-memory index once per session
            timings, bare = [], []
            for probe in probes[20:]:
                t = time.perf_counter()
                memory.retrieve(probe, k=8, categories=["casual_dialog", "memorial_archive", "dream_content"])
                timings.append(time.perf_counter() - t)
                t = time.perf_counter()
                numpy_scan(matrix, probe, 8)
                bare.append(time.perf_counter() - t)
            report[f"retrieval_{n}"] = percentiles(timings)
            report[f"numpy_scan_{n}"] = percentiles(bare)
            if n == sizes[0]:
                report[f"prompt_assembly_{n}"] = assembly_latency(memory, 8 if smoke else 30)
            memory.close()
    largest = sizes[-1]
    return {
        "retrieval_over_numpy_scan_p50_ratio": (
            report[f"retrieval_{largest}"]["p50_ms"] / report[f"numpy_scan_{largest}"]["p50_ms"]
        ),
        "batched_over_single_write_ratio": batched / single,
        "goal": (
            "retrieval p95 <= 20 ms at 100k entries (figure retrieval_100000.p95_ms, absolute); the "
            "ratio is search + filters + re-rank + access update over a bare numpy top-k scan of "
            "the same vectors at the largest size"
        ),
        "largest_entries": largest,
        **report,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
