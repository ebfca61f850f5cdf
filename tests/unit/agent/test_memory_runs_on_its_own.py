"""The memory runtime runs on its own, fed by real use: the scheduler ticks the dream engine (a
cycle runs from the scheduler on an injected clock, its LLM modes reported skipped without a
teacher), and an exchange recorded through the MCP server's tool is indexed with the valence of
its events and the caller's trait profile, and those events move the hormones (the dream gate
counts its session). Real stores; the hash embedder stands in for MiniLM (tests/helpers)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nimmer_train.agent.dreams import LLM_MODES, DreamEngine
from nimmer_train.agent.exchange_feed import exchange_tool
from nimmer_train.agent.hormones import REST
from nimmer_train.agent.ingestion import Exchange, TranscriptIndexer, index_exchanges
from nimmer_train.agent.scheduler import ConsolidationScheduler
from nimmer_train.agent.tool_registry import ToolArgumentError
from nimmer_train.agent.tools import memory_tools
from tests.helpers.memory import Clock, agent_memory

HOUR = 3600.0


def _sessions(agent, clock: Clock, n: int = 3) -> None:  # noqa: ANN001
    index_exchanges(
        agent,
        [
            Exchange(
                f"s{s}",
                (f"s{s}-t{t}",),
                (("user", f"remark {s}.{t} about the mill"), ("npc", "aye")),
                clock.now,
            )
            for s in range(n)
            for t in range(4)
        ],
    )


def test_the_scheduler_runs_a_dream_cycle_on_an_injected_clock(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    _sessions(agent, clock)
    scheduler = ConsolidationScheduler(agent, tick_s=3600, dreams=DreamEngine(agent, seed=3))
    scheduler.tick()  # new sessions, but the agent was active just now: the gate stays shut
    assert scheduler.info()["dreams"]["cycles"] == 0
    clock.now += 2 * HOUR  # idle for two hours of game time
    scheduler.tick()
    dreams = scheduler.info()["dreams"]
    assert dreams["cycles"] == 1 and dreams["ticks"] == 2
    assert dreams["llm_modes"] == "skipped: no teacher"
    for mode, outcome in dreams["last"]["modes"].items():
        if mode in LLM_MODES:
            assert outcome["skipped"] == "no teacher"
    assert DreamEngine(agent).state()["cycles"] == 1  # the engine's own record agrees
    assert agent.memory_status()["scheduler"]["dreams"]["cycles"] == 1
    agent.close()


def test_the_started_scheduler_ticks_the_dream_engine(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    _sessions(agent, clock)
    clock.now += 2 * HOUR
    scheduler = ConsolidationScheduler(agent, tick_s=0.05, dreams=DreamEngine(agent)).start()
    try:
        for _ in range(600):  # a hang guard, not a timing: the job fires every 50 ms
            if scheduler.info()["dreams"]["cycles"]:
                break
            time.sleep(0.05)
    finally:
        scheduler.shutdown()
    assert scheduler.info()["dreams"]["cycles"] == 1  # later ticks: 8 h have not passed
    agent.close()


def test_a_recorded_exchange_is_indexed_and_moves_the_hormones(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    indexer = TranscriptIndexer(agent)
    registry = memory_tools(agent)
    registry.register(exchange_tool(agent, indexer))
    before = agent.hormones.levels(clock.now)
    out = registry.call(
        "memory_record_exchange",
        {
            "messages": [
                {"role": "user", "content": "Thank you, friend, the bounty is yours: we did it!"},
                {"role": "assistant", "content": "Glad to help."},
            ],
            "sessionId": "chat-1",
            "turnId": "t1",
            "traits": {"Philotes": 0.8},
        },
    )
    assert {"reward", "achievement", "social"} <= set(out["events"]) and out["valence"] > 0
    assert indexer.flush(timeout=60)
    after = agent.hormones.levels(clock.now)
    assert after["dopamine"] > before["dopamine"] > REST["dopamine"] - 1e-9
    assert after["oxytocin"] > before["oxytocin"]
    hits = agent.memory_search("bounty", 3, 0.0)
    assert hits and hits[0]["turn_ids"] == ["t1"] and hits[0]["session_id"] == "chat-1"
    row = (
        agent.db("primary")
        .execute("SELECT emotional_valence, trait_engagement FROM entries WHERE session_id = 'chat-1'")
        .fetchone()
    )
    assert row[0] == pytest.approx(out["valence"]) and json.loads(row[1]) == {"Philotes": 0.8}
    assert DreamEngine(agent).status()["gate"]["new_sessions"] == 1
    with pytest.raises(ToolArgumentError, match="traits"):
        registry.call(
            "memory_record_exchange",
            {"messages": [{"role": "user", "content": "hi"}], "sessionId": "x", "traits": {"Nope": 1}},
        )
    indexer.close()
    agent.close()
