"""Knowledge crystals: retrieval quality on generated multi-session dialogues, search latency,
consolidation wall time and transcript indexing lag, measured in one process on this machine.

- Quality: a seeded generator writes multi-session conversations (user + assistant exchanges,
  a day between sessions) with planted facts, preferences and updates (a fact that changes in a
  later session), among filler and distractors (the same attributes said of other people).
  Every exchange is indexed as an episode crystal (all-MiniLM-L6-v2). Each question has known
  evidence turn ids; evidence recall@k (k = 1, 5, 10) is reported for hybrid search (vector +
  FTS5 BM25, RRF, recency) and vector-only, and for update questions the mean rank of the latest
  and of the superseded evidence and the share where the latest ranks above; also the mean
  evidence rank and recall@1 of direct and of paraphrased questions. ``generate(realistic=True)``
  (the default) makes it harder: sessions 1 to 10 days apart, half the questions direct (a
  shared content word) and half paraphrased (no copy of the planted sentence), updates that may
  not repeat the old value, and other people's changes as distractors; ``realistic=False`` is
  the first generator (a day between sessions, paraphrases only).
- memory_search p50 / p95 at 10k and 100k crystals (random unit vectors and random-word texts;
  the query vector is given, so this is search + fusion + access update + log, not the
  embedding, which is timed apart). Goal: p95 <= 20 ms.
- Consolidation wall time at 10k and 100k crystals: the first run (rescoring everything, one
  merge batch of 2,000 unchecked crystals against all) and a steady-state run (backlog worked
  through) after 1 % new crystals. Goal: 10k in under 1 s.
- Transcript indexing lag: exchanges submitted to the background indexer at once; seconds from
  submit to commit, p50 / p95.

python -m benchmarks.bench_crystals [--smoke]
"""

from __future__ import annotations

import random
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nimmer_train.agent import dialogues
from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.consolidation import consolidate
from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.dialogues import (
    ADJECTIVES,
    COLOURS,
    DAY,
    FOODS,
    JOBS,
    MONTHS,
    PETS,
    PLACES,
    START,
    TOPICS,
)
from nimmer_train.agent.ingestion import Exchange, TranscriptIndexer, index_exchanges
from nimmer_train.agent.search import SearchWeights
from nimmer_train.memory.embedding import SentenceEmbedder

# the vocabulary of agent/dialogues.py, the project's generator of long dialogues; the slices keep
# this generator's first choices (so its seeded conversations, and its figures, stay as they were)
NAMES = list(dialogues.NAMES[:12])
CITIES = list(dialogues.CITIES[:10])
JOBS, PLACES, PETS, FOODS = list(JOBS), list(PLACES), list(PETS), list(FOODS)
DRINKS = ["green tea", "black coffee", "hot chocolate", "apple juice", "mint tea"]
HOBBIES = ["climbing", "pottery", "chess", "sailing", "birdwatching", "woodcarving", "running"]
COLOURS, MONTHS = list(COLOURS), list(MONTHS)
FILLER = list(dialogues.FILLER[:10])
REALISTIC_FILLER = [  # other people's changes: the same topics as the user's updates
    *dialogues.FILLER[10:13],
    "My cousin {name} lives in {city} now and loves it.",
    "What do you think makes a good {job}?",
]
REPLIES = list(dialogues.REPLIES[:5])


@dataclass
class Question:
    text: str
    evidence: str  # the turn id that answers it
    superseded: str | None = None  # for updates: the older, now wrong, evidence
    keyword: bool = False  # shares a content word with the evidence (the direct phrasing)


@dataclass
class Conversation:
    exchanges: list[tuple[str, str, str, float]] = field(default_factory=list)  # (turn id, user, reply, at)
    questions: list[Question] = field(default_factory=list)
    end: float = START  # the clock when the questions are asked: a day after the last session


def _facts(rng: random.Random) -> list[tuple[str, str, str]]:
    """(statement, paraphrased question, direct question) planted once; the paraphrase shares no
    content word with the statement, the direct one does (as real users ask)."""
    pet, pet_name = rng.choice(PETS)
    return [
        (
            f"By the way, my sister is called {rng.choice(NAMES)}.",
            "What is my sister's name?",
            "What is my sister called?",
        ),
        (f"I work as a {rng.choice(JOBS)} these days.", "What do I do for a living?", "What is my work?"),
        (
            f"We adopted a {pet} named {pet_name} last spring.",
            "What is the name of our pet?",
            f"What did we call the {pet} we adopted?",
        ),
        (
            f"My birthday is on the {rng.randint(2, 28)}th of {rng.choice(MONTHS)}.",
            "When is my birthday?",
            "Which day should you congratulate me on getting older?",
        ),
        (
            f"I grew up in {rng.choice(CITIES)}, a long time ago.",
            "Where was I raised as a child?",
            "Which town did I grow up in?",
        ),
        (
            f"I really prefer {rng.choice(DRINKS)} to anything else in the morning.",
            "What do I like to drink?",
            "What do I prefer in the morning?",
        ),
        (
            f"Honestly my favourite dish is {rng.choice(FOODS)}.",
            "Which meal do I love most?",
            "What is my favourite dish?",
        ),
        (
            f"On weekends I love {rng.choice(HOBBIES)} with friends.",
            "What is my weekend pastime?",
            "What do I do with friends on weekends?",
        ),
    ]


def _updates(rng: random.Random) -> list[tuple[str, str, str, str, str]]:
    """(first statement, later update that names the old value, later update that does not,
    paraphrased question, direct question)."""
    city, city2 = rng.sample(CITIES, 2)
    place, place2 = rng.sample(PLACES, 2)
    colour, colour2 = rng.sample(COLOURS, 2)
    return [
        (
            f"I live in {city} at the moment.",
            f"Big news: we moved from {city} to {city2} last week.",
            f"We finally settled into our new flat in {city2}.",
            "Which city is my home now?",
            "Where do I live?",
        ),
        (
            f"I work at the {place}.",
            f"I quit my job at the {place}, I am at the {place2} now.",
            f"First week at the {place2} went well, the new colleagues are kind.",
            "Where is my workplace these days?",
            "Where do I work?",
        ),
        (
            f"My car is {colour}.",
            f"I had my car repainted {colour2}, it used to be {colour}.",
            f"The garage finished the paint job, the car is {colour2} now.",
            "What colour is my car currently?",
            "What colour is my car?",
        ),
    ]


def generate(seed: int, sessions: int, per_session: int, realistic: bool = True) -> Conversation:
    """A seeded conversation. ``realistic``: sessions 1 to 10 days apart (not one), half the
    questions asked directly (sharing a content word with the evidence) and half paraphrased,
    updates that may not repeat the old value, and other people's changes as distractors
    ("My friend Ines moved from Oslo to Porto")."""
    rng = random.Random(seed)
    conv = Conversation()
    slots = [(s, t) for s in range(sessions) for t in range(per_session)]
    plants: dict[tuple[int, int], str] = {}
    half = sessions // 2
    for statement, paraphrase, direct in _facts(rng):
        slot = rng.choice([x for x in slots if x not in plants])
        plants[slot] = statement
        keyword = realistic and rng.random() < 0.5
        conv.questions.append(
            Question(direct if keyword else paraphrase, f"s{slot[0]}-t{slot[1]}", None, keyword)
        )
    for first, update, quiet_update, paraphrase, direct in _updates(rng):
        early = rng.choice([x for x in slots if x not in plants and x[0] < half])
        late = rng.choice([x for x in slots if x not in plants and x[0] >= half])
        quiet = realistic and rng.random() < 0.5
        plants[early], plants[late] = first, quiet_update if quiet else update
        keyword = realistic and rng.random() < 0.5
        conv.questions.append(
            Question(
                direct if keyword else paraphrase,
                f"s{late[0]}-t{late[1]}",
                f"s{early[0]}-t{early[1]}",
                keyword,
            )
        )
    fillers = FILLER + (REALISTIC_FILLER if realistic else [])
    day = [0.0]
    for _ in range(sessions - 1):
        day.append(day[-1] + (rng.randint(1, 10) if realistic else 1))
    for s, t in slots:
        said = plants.get((s, t))
        if said is None:
            template = rng.choice(fillers)  # drawn first, as the first generator did
            fill = dict(
                adj=rng.choice(ADJECTIVES),
                topic=rng.choice(TOPICS),
                name=rng.choice(NAMES),
                city=rng.choice(CITIES),
                job=rng.choice(JOBS),
                pet=rng.choice(PETS)[0],
                food=rng.choice(FOODS),
                hobby=rng.choice(HOBBIES),
            )
            if realistic:
                fill.update(city2=rng.choice(CITIES), colour=rng.choice(COLOURS), place=rng.choice(PLACES))
            said = template.format(**fill)
        conv.exchanges.append((f"s{s}-t{t}", said, rng.choice(REPLIES), START + day[s] * DAY + t * 60))
    conv.end = START + (day[-1] + 1) * DAY
    return conv


def _rank(hits: list[dict], turn: str) -> int | None:
    for n, hit in enumerate(hits, start=1):
        if turn in hit["turn_ids"]:
            return n
    return None


def indexed(embedder: SentenceEmbedder, conv: Conversation, folder: Path) -> AgentMemory:
    """An agent whose memory holds ``conv``'s exchanges as episode crystals, its clock at the end."""
    agent = AgentMemory(folder, embedder, clock=lambda end=conv.end: end)
    index_exchanges(
        agent,
        [
            Exchange("conv", (turn,), (("user", said), ("assistant", reply)), at)
            for turn, said, reply, at in conv.exchanges
        ],
    )
    return agent


def quality(
    embedder: SentenceEmbedder,
    seeds: list[int],
    sessions: int,
    per_session: int,
    realistic: bool = True,
    weights: SearchWeights | None = None,
) -> dict[str, float]:
    """Evidence recall@k, mean evidence rank (51 when not in the top 50), recall@1 of direct and
    of paraphrased questions, and for updates the ranks of the latest and superseded evidence."""
    modes = {"hybrid": True, "vector": False}
    ranks: dict[str, list[int]] = {name: [] for name in modes}
    direct: dict[str, list[int]] = {name: [] for name in modes}
    latest: dict[str, list[int]] = {name: [] for name in modes}
    old: dict[str, list[int]] = {name: [] for name in modes}
    for seed in seeds:
        conv = generate(seed, sessions, per_session, realistic)
        with tempfile.TemporaryDirectory() as tmp:
            agent = indexed(embedder, conv, Path(tmp))
            agent.weights = weights or agent.weights
            for q in conv.questions:
                for name, use_text in modes.items():
                    hits = agent.memory_search(q.text, 50, -1.0, use_text=use_text, record_access=False)
                    rank = _rank(hits, q.evidence) or 51
                    ranks[name].append(rank)
                    direct[name].append(int(q.keyword))
                    if q.superseded is not None:
                        latest[name].append(rank)
                        old[name].append(_rank(hits, q.superseded) or 51)
            agent.close()
    out: dict[str, float] = {"questions": len(ranks["hybrid"]), "update_questions": len(latest["hybrid"])}
    for name in modes:
        r, d = np.array(ranks[name]), np.array(direct[name], dtype=bool)
        for k in (1, 5, 10):
            out[f"{name}_recall_at_{k}"] = float(np.mean(r <= k))
        out[f"{name}_mean_rank"] = float(np.mean(r))
        if d.any() and (~d).any():
            out[f"{name}_direct_recall_at_1"] = float(np.mean(r[d] <= 1))
            out[f"{name}_paraphrase_recall_at_1"] = float(np.mean(r[~d] <= 1))
        new, before = np.array(latest[name]), np.array(old[name])
        out[f"{name}_update_latest_mean_rank"] = float(np.mean(new))
        out[f"{name}_update_superseded_mean_rank"] = float(np.mean(before))
        out[f"{name}_update_latest_first_share"] = float(np.mean(new < before))
    return out


WORDS = [f"w{i}" for i in range(5000)]


class GivenVectors:
    """An embedder stand-in for the latency runs: returns the prepared unit vectors in order."""

    name, dim = "given", 384

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def embed(self, texts: list[str]) -> np.ndarray:
        v = self.rng.standard_normal((len(texts), 384)).astype(np.float32)
        return v / np.linalg.norm(v, axis=1, keepdims=True)


def filled(folder: Path, n: int, rng: np.random.Generator) -> AgentMemory:
    clock = [START]
    agent = AgentMemory(folder, GivenVectors(rng), clock=lambda: clock[0])
    agent.clock_cell = clock  # type: ignore[attr-defined]
    words = rng.integers(0, len(WORDS), size=(n, 12))
    for start in range(0, n, 5000):
        batch = [
            CrystalSpec(" ".join(WORDS[w] for w in words[i]), "note", valid_from=START - (n - i) * 60)
            for i in range(start, min(n, start + 5000))
        ]
        agent.add(batch)
    return agent


def latency(n: int, queries: int, rng: np.random.Generator) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        agent = filled(Path(tmp), n, rng)
        samples = []
        for _ in range(queries):
            # a question about the player, so every search also reads whose fact its candidates
            # state (agent/subjects.py): the slower path
            text = "what did I say of " + " ".join(WORDS[w] for w in rng.integers(0, len(WORDS), 4))
            vector = agent.embedder.embed([text])[0]
            started = time.perf_counter()
            agent.memory_search(text, 6, 0.0, vector=vector)
            samples.append(time.perf_counter() - started)
        ms = np.array(samples[5:] or samples) * 1000  # the first queries warm the index
        agent.close()
    return {
        f"search_{n}_p50_ms": float(np.percentile(ms, 50)),
        f"search_{n}_p95_ms": float(np.percentile(ms, 95)),
    }


def consolidation(n: int, rng: np.random.Generator) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        agent = filled(Path(tmp), n, rng)
        agent.clock_cell[0] += 3 * DAY  # type: ignore[attr-defined]
        started = time.perf_counter()
        consolidate(agent)
        first = time.perf_counter() - started
        db = agent.db("primary")
        backlog = db.execute("SELECT count(*) FROM crystals WHERE merge_checked = 0").fetchone()[0]
        with db:  # steady state: the fill's merge backlog counts as worked through
            db.execute("UPDATE crystals SET merge_checked = 1")
        agent.add([CrystalSpec(f"new remark {i}", "note") for i in range(max(1, n // 100))])
        agent.clock_cell[0] += 1800  # type: ignore[attr-defined]
        started = time.perf_counter()
        consolidate(agent)
        steady = time.perf_counter() - started
        agent.close()
    return {
        f"consolidation_{n}_first_s": first,
        f"consolidation_{n}_merge_backlog_after_first": backlog,
        f"consolidation_{n}_steady_s": steady,
    }


def indexing_lag(embedder: SentenceEmbedder, n: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as tmp:
        agent = AgentMemory(Path(tmp), embedder, clock=lambda: START)
        indexer = TranscriptIndexer(agent)
        started = time.perf_counter()
        for i in range(n):
            indexer.submit(
                Exchange(
                    "s", (f"t{i}",), (("user", f"question {i} about the harbour"), ("npc", "aye")), START
                )
            )
        submit_s = time.perf_counter() - started
        indexer.flush()
        lags = np.array(indexer.lags_s)
        indexer.close()
        agent.close()
    return {
        "index_exchanges": n,
        "index_submit_ms_per_exchange": submit_s / n * 1000,
        "index_lag_p50_s": float(np.percentile(lags, 50)),
        "index_lag_p95_s": float(np.percentile(lags, 95)),
    }


def run(smoke: bool = False) -> dict[str, object]:
    rng = np.random.default_rng(0)
    embedder = SentenceEmbedder()
    started = time.perf_counter()
    embedder.embed(["warm up"])
    figures: dict[str, object] = {}
    if smoke:
        figures.update(quality(embedder, [0], sessions=3, per_session=8))
        for n in (200,):
            figures.update(latency(n, 10, rng))
            figures.update(consolidation(n, rng))
        figures.update(indexing_lag(embedder, 10))
        big, small = 200, 200
    else:
        figures.update(quality(embedder, [0, 1, 2, 3, 4], sessions=10, per_session=20))
        for n in (10_000, 100_000):
            figures.update(latency(n, 200, rng))
            figures.update(consolidation(n, rng))
        figures.update(indexing_lag(embedder, 200))
        big, small = 100_000, 10_000
    t0, embeds = time.perf_counter(), 5 if smoke else 20
    for _ in range(embeds):
        embedder.embed(["where does the user live now"])
    figures["query_embedding_ms"] = (time.perf_counter() - t0) / embeds * 1000
    figures["total_s"] = time.perf_counter() - started
    ratios = {
        "hybrid_over_vector_recall_at_5_ratio": figures["hybrid_recall_at_5"]
        / max(1e-9, figures["vector_recall_at_5"]),  # type: ignore[operator]
        "search_p95_over_goal_ratio": figures[f"search_{big}_p95_ms"] / 20.0,  # type: ignore[operator]
        "consolidation_first_over_goal_ratio": figures[f"consolidation_{small}_first_s"] / 1.0,  # type: ignore[operator]
    }
    return {
        **ratios,
        "goal": "memory_search p95 <= 20 ms at 100k crystals (search_p95_over_goal_ratio <= 1); "
        "consolidation of 10k crystals under 1 s (consolidation_first_over_goal_ratio < 1); "
        "hybrid evidence recall@5 at least vector-only's (hybrid_over_vector_recall_at_5_ratio >= 1)",
        **figures,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
