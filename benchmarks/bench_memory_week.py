"""A simulated week of one NPC's life on 10k crystals: sessions, game events (hormone spikes),
searches (some finding little, so curiosity opens gaps), consolidation every 2 game hours (which
rebuilds curiosity), and a dream tick every 30 game minutes (gate, mini-dreams, full cycles).

The four LLM dream modes ask the loopback OpenAI-compatible stand-in (tests/helpers/llm_server.py;
a hosted teacher cannot run here) through issue 3's ``OpenAICompatible`` backend; it echoes the
first source back with a twist, so the relevance gate keeps it. Texts are embedded with the
hash-trigram stand-in (tests/helpers/memory.py): this measures the engine's bookkeeping and
budgets, not retrieval quality (bench_crystals does that with all-MiniLM-L6-v2).

Figures: wall time (total, consolidation, dream ticks), full cycles and mini-dreams, insights
made per mode, crystals archived by compression, LLM calls spent against the budget (per-cycle
cap x cycles, and per-hour cap), curiosity targets opened.

python -m benchmarks.bench_memory_week [--smoke]
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import numpy as np

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.consolidation import consolidate
from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.dreams import MODES, DreamConfig, DreamEngine
from nimmer_train.config.teacher import TeacherConfig
from nimmer_train.synth.teacher.backends import OpenAICompatible
from tests.helpers.llm_server import serve
from tests.helpers.memory import Clock, HashEmbedder

HOUR = 3600.0
PEOPLE = ["Ilse", "Greta", "Tomas", "Jorunn", "Mara", "Pavel", "Ines", "Oskar", "Lena", "Birk"]
PLACES = ["the east gate", "the mill", "the harbour", "the chapel", "the salt market", "the forge"]
ACTS = ["trades wool", "argues about taxes", "sings old songs", "repairs nets", "hides a letter"]
TWISTS = [" every morning", " at dusk", " again", " with a friend", " in the rain"]


def _line(rng: np.random.Generator) -> str:
    return f"{rng.choice(PEOPLE)} {rng.choice(ACTS)} at {rng.choice(PLACES)}{rng.choice(TWISTS)}"


def _echo(body: dict) -> str:
    first = body["messages"][1]["content"].split("\n- ")[1].split("\n")[0]
    return json.dumps({"insights": [{"text": f"{first}, and it may happen again", "confidence": 0.7}]})


def week(folder: Path, crystals: int, days: int, seed: int = 0) -> dict[str, object]:
    rng = np.random.default_rng(seed)
    clock = Clock()
    agent = AgentMemory(folder, HashEmbedder(), clock=clock)
    started = time.perf_counter()
    batch = 2000
    for start in range(0, crystals, batch):
        agent.add(
            [
                CrystalSpec(text=_line(rng), origin="transcript", session_id=f"past-{start // batch}")
                for _ in range(min(batch, crystals - start))
            ]
        )
    setup_s = time.perf_counter() - started
    consolidate(agent, clock.now)  # the backlog's first pass, before the week starts
    cfg = DreamConfig()
    consolidation_s = dream_s = 0.0
    consolidations = 0
    with serve(_echo) as server:
        teacher = OpenAICompatible(
            TeacherConfig(
                backend="openai_compatible", base_url=server.url + "/v1", max_retries=0, timeout_s=30
            )
        )
        engine = DreamEngine(agent, teacher=teacher, config=cfg, seed=seed)
        ticks: list[dict] = []
        t0 = time.perf_counter()
        for half_hour in range(days * 48):
            clock.now += HOUR / 2
            hour_of_day = (half_hour // 2) % 24
            if hour_of_day in (10, 18) and half_hour % 2 == 0:  # a session: 20 exchanges
                day = half_hour // 48
                agent.add(
                    [
                        CrystalSpec(text=_line(rng), origin="transcript", session_id=f"d{day}h{hour_of_day}")
                        for _ in range(20)
                    ]
                )
                agent.hormones.spike(str(rng.choice(["reward", "social", "error", "achievement"])), clock.now)
                for _ in range(3):
                    agent.memory_search(_line(rng))
                if hour_of_day == 18:
                    for q in ("dragon eggs", "the moon tax", "glass owls"):
                        agent.memory_search(q, min_score=0.9)
            if half_hour % 4 == 0:
                c0 = time.perf_counter()
                consolidate(agent, clock.now)
                consolidation_s += time.perf_counter() - c0
                consolidations += 1
            d0 = time.perf_counter()
            ticks.append(engine.tick())
            dream_s += time.perf_counter() - d0
        week_s = time.perf_counter() - t0
        requests = len(server.requests)
    status = engine.status()
    state = engine.state()
    cycles, minis = state["cycles"], state["mini_dreams"]
    calls = sum(r.get("calls", 0) for t in ticks for r in t.get("results", {}).values())
    archived = sum(r.get("archived", 0) for t in ticks for r in t.get("results", {}).values())
    archived += sum(t.get("archived", 0) for t in ticks if t["ran"] == "mini")
    targets = (
        agent.db("primary")
        .execute("SELECT value FROM memory_meta WHERE key = 'curiosity_targets'")
        .fetchone()
    )
    opened = len(json.loads(targets[0])) if targets else 0
    agent.close()
    return {
        "crystals_start": crystals,
        "days": days,
        "setup_s": round(setup_s, 3),
        "week_wall_s": round(week_s, 3),
        "consolidation_s": round(consolidation_s, 3),
        "consolidations": consolidations,
        "dream_ticks_s": round(dream_s, 3),
        "full_cycles": cycles,
        "mini_dreams": minis,
        "insights_by_mode": {m: int(state["insights"][m]) for m in MODES},
        "insights_total": int(sum(state["insights"].values())),
        "insights_live": status["insights"]["live"],
        "archived_by_compression": archived,
        "llm_calls": calls,
        "llm_requests_served": requests,
        "llm_budget_cycles": cycles * cfg.calls_per_cycle,
        "llm_budget_per_hour": cfg.calls_per_hour,
        "curiosity_targets_recorded": opened,
    }


def run(smoke: bool = False) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        figures = week(Path(tmp) / "npc", 500 if smoke else 10_000, 2 if smoke else 7)
    budget = max(1, int(figures["llm_budget_cycles"]))  # type: ignore[call-overload]
    ratios = {
        "llm_calls_over_budget_ratio": figures["llm_calls"] / budget,  # type: ignore[operator]
        "dream_share_of_week_ratio": figures["dream_ticks_s"] / max(1e-9, figures["week_wall_s"]),  # type: ignore[operator]
    }
    return {
        **ratios,
        "goal": "LLM calls never exceed the per-cycle budget (llm_calls_over_budget_ratio <= 1); dreams "
        "a small share of the week's memory work (dream_share_of_week_ratio well under 1)",
        **figures,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
