"""Recall on long conversations: evidence recall@k and session hit@k per question category
(single-hop, multi-hop, temporal, updated fact, open-domain) for memory_search over an agent
whose memory holds every exchange of long multi-session dialogues (nimmer_train/agent/dialogues.py:
seeded, dated sessions, planted facts, updates and distractors), with search p50 / p95 at 10k
and 100k crystals beside them.

Three query paths, over the same indexed crystals:

- ``vector``: the question's embedding alone (cosine);
- ``hybrid``: memory_search as the tools call it (vector + FTS5 BM25 fused, recency, the date
  a question names);
- ``turn``: the runtime's memory query (runtime/conversation.query_vector: the question with
  the player's last lines before it, weighted) through memory_search, as a turn asks it at the
  end of the last session.

Seeds: ``DEV_SEEDS`` tuned the weights, ``HELD_OUT_SEEDS`` are reported (their misses have been
read to design changes since), ``READ_SEEDS`` (300-309) were unseen until their misses were read
to design agent/subjects.py (2026-12-06), ``UNSEEN_SEEDS`` (700-719) nobody looked into: a change
that helps only the first three is tuned to them.

Evidence recall@k: the share of all evidence turns (a multi-hop question has two) found in the
top k; session hit@k: the share of questions with a top-k hit in one of their evidence sessions.
Goal (issue 40): hybrid evidence recall@10 >= 0.70, session hit@10 >= 0.95, search p95 <= 20 ms
at 100k crystals. Weights were tuned on seeds 0-4 (the ``dev`` figures); the headline figures
and the ratios are the held-out seeds 100-104, which no tuning saw. The latency runs read the
machine's load average beside them (a shared 2-core machine: say it with the figure). From 20k
crystals the vector side scans the query's k-means cells (memory/vector_cells.py), not every row.
``--smoke``: one small conversation, 2k crystals for latency.

python -m benchmarks.bench_conversation_memory [--smoke]
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.bench_crystals import latency
from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.dialogues import CATEGORIES, Dialogue, generate
from nimmer_train.agent.ingestion import Exchange, index_exchanges
from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.runtime.conversation import Line, query_vector
from nimmer_train.voice.prompt_dsl import PLAYER

PATHS = ("vector", "hybrid", "turn")
KS = (1, 5, 10)
DEV_SEEDS = range(5)  # what the weights were tuned on
HELD_OUT_SEEDS = range(100, 105)  # what the figures are reported on (their misses have been read)
READ_SEEDS = range(300, 310)  # unseen until their misses were read for agent/subjects.py
UNSEEN_SEEDS = range(700, 720)  # never looked into: the check that a change is not tuned to the above


def indexed(embedder, dialogue: Dialogue, folder: Path) -> AgentMemory:  # noqa: ANN001 - an Embedder
    """An agent whose memory holds every exchange of ``dialogue``, its clock at the end."""
    agent = AgentMemory(folder, embedder, clock=lambda end=dialogue.end: end)
    index_exchanges(
        agent,
        [
            Exchange(f"session-{s + 1}", (turn,), ((PLAYER, said), ("npc:companion", reply)), at)
            for turn, s, said, reply, at in dialogue.exchanges
        ],
    )
    return agent


def _recent(dialogue: Dialogue, k: int = 4) -> list[Line]:
    """The player's last ``k`` lines, newest first (what a turn at the end would hold)."""
    return [
        Line(PLAYER, said, at, f"{turn}-p", turn)
        for turn, _s, said, _r, at in reversed(dialogue.exchanges[-k:])
    ]


def search(agent: AgentMemory, dialogue: Dialogue, question: str, path: str, k: int) -> list[dict]:
    if path == "vector":
        return agent.memory_search(question, k, -1.0, use_text=False, record_access=False)
    vector = None
    if path == "turn":
        vector = query_vector(agent.embedder, question, _recent(dialogue))
    return agent.memory_search(question, k, -1.0, vector=vector, record_access=False)


def score(hits: list[dict], evidence: tuple[str, ...], sessions: tuple[int, ...], k: int) -> tuple[int, bool]:
    """(evidence turns in the top k, whether a top-k hit is in an evidence session)."""
    top = hits[:k]
    turns = {t for hit in top for t in hit["turn_ids"]}
    wanted = {f"session-{s + 1}" for s in sessions}
    return sum(t in turns for t in evidence), any(hit["session_id"] in wanted for hit in top)


def quality(embedder, seeds: list[int], sessions: int, per_session: int) -> dict[str, float]:  # noqa: ANN001
    """Per path and category: evidence recall@k and session hit@k (k = 1, 5, 10), and overall."""
    found = {(p, c, k): [0, 0] for p in PATHS for c in (*CATEGORIES, "all") for k in KS}
    hits_at = {(p, c, k): [0, 0] for p in PATHS for c in (*CATEGORIES, "all") for k in KS}
    for seed in seeds:
        dialogue = generate(seed, sessions, per_session)
        with tempfile.TemporaryDirectory() as tmp:
            agent = indexed(embedder, dialogue, Path(tmp))
            for q in dialogue.questions:
                for path in PATHS:
                    hits = search(agent, dialogue, q.text, path, max(KS))
                    for k in KS:
                        n, hit = score(hits, q.evidence, q.sessions, k)
                        for c in (q.category, "all"):
                            found[path, c, k][0] += n
                            found[path, c, k][1] += len(q.evidence)
                            hits_at[path, c, k][0] += int(hit)
                            hits_at[path, c, k][1] += 1
            agent.close()
    out: dict[str, float] = {}
    for (path, c, k), (n, total) in found.items():
        out[f"{path}_{c}_recall_at_{k}"] = n / max(1, total)
        h, questions = hits_at[path, c, k]
        out[f"{path}_{c}_session_hit_at_{k}"] = h / max(1, questions)
    out["questions"] = hits_at["hybrid", "all", 1][1]
    out["exchanges"] = len(seeds) * sessions * per_session
    return out


def table(figures: dict[str, float], path: str = "hybrid") -> str:
    """A per-category Markdown table of one path (recall@1/5/10, session hit@10)."""
    rows = ["| category | R@1 | R@5 | R@10 | session hit@10 |", "|---|---|---|---|---|"]
    for c in (*CATEGORIES, "all"):
        cells = [f"{figures[f'{path}_{c}_recall_at_{k}']:.2f}" for k in KS]
        rows.append(f"| {c} | {' | '.join(cells)} | {figures[f'{path}_{c}_session_hit_at_10']:.2f} |")
    return "\n".join(rows)


def run(smoke: bool = False) -> dict[str, object]:
    """The benchmark contract's entry point: the default size (5 seeds x 20 sessions x 30 exchanges)."""
    return measure(smoke)


def measure(
    smoke: bool = False, seeds: int = 5, sessions: int = 20, per_session: int = 30
) -> dict[str, object]:
    embedder = SentenceEmbedder()
    embedder.embed(["warm up"])
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    if smoke:
        figures: dict[str, object] = quality(embedder, [100], 4, 10)
        figures.update(latency(2000, 20, rng))
        sizes: tuple[int, ...] = (2000,)
    else:
        figures = quality(embedder, list(HELD_OUT_SEEDS)[:seeds], sessions, per_session)
        dev = quality(embedder, list(DEV_SEEDS)[:seeds], sessions, per_session)
        figures.update({f"dev_{key}": value for key, value in dev.items()})
        read = quality(embedder, list(READ_SEEDS)[: 2 * seeds], sessions, per_session)
        figures.update({f"read_{key}": value for key, value in read.items()})
        unseen = quality(embedder, list(UNSEEN_SEEDS)[: 4 * seeds], sessions, per_session)
        figures.update({f"unseen_{key}": value for key, value in unseen.items()})
        sizes = (10_000, 100_000)
    for n in sizes:
        figures[f"load_average_before_{n}"] = os.getloadavg()[0]
        figures.update(latency(n, 20 if smoke else 200, rng))
        figures[f"load_average_after_{n}"] = os.getloadavg()[0]
    figures["cpus"] = os.cpu_count() or 0
    figures["total_s"] = time.perf_counter() - started
    for path in PATHS:
        print(f"\n{path} (held-out seeds):\n{table(figures, path)}")  # type: ignore[arg-type]
    for seeds_read in ("dev", "read", "unseen"):
        if f"{seeds_read}_hybrid_all_recall_at_10" in figures:
            print(f"\nhybrid ({seeds_read} seeds):\n{table(figures, f'{seeds_read}_hybrid')}")  # type: ignore[arg-type]
    big = sizes[-1]
    unseen_ratio = {}  # not in a smoke run
    if "unseen_hybrid_all_session_hit_at_10" in figures:
        hit = figures["unseen_hybrid_all_session_hit_at_10"]
        unseen_ratio["unseen_hybrid_session_hit_at_10_over_goal_ratio"] = hit / 0.95  # type: ignore[operator]
    return {
        "hybrid_recall_at_10_over_goal_ratio": figures["hybrid_all_recall_at_10"] / 0.70,  # type: ignore[operator]
        "hybrid_session_hit_at_10_over_goal_ratio": figures["hybrid_all_session_hit_at_10"] / 0.95,  # type: ignore[operator]
        **unseen_ratio,
        "hybrid_over_vector_recall_at_10_ratio": figures["hybrid_all_recall_at_10"]  # type: ignore[operator]
        / max(1e-9, figures["vector_all_recall_at_10"]),  # type: ignore[operator]
        "search_p95_over_goal_ratio": figures[f"search_{big}_p95_ms"] / 20.0,  # type: ignore[operator]
        "goal": "hybrid evidence recall@10 >= 0.70 and session hit@10 >= 0.95 on held-out seeds (ratios "
        "over goal >= 1) and on the unseen seeds no tuning or design looked into; memory_search "
        "p95 <= 20 ms at 100k crystals (search_p95_over_goal_ratio <= 1; read it with "
        "load_average_*: the machine is shared)",
        **figures,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
