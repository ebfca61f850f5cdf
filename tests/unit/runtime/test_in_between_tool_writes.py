"""An in-between turn served by Ring C writes nothing through the memory tools: the provider (the
loopback stand-in, tests/helpers/llm_server.py: a third party we cannot run here) is offered only
tools that read, and a call to a writing tool it sends anyway is answered as an error, so the
player's in-between line never lands in memory/scratch.md or primary.sqlite."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nimmer_train.agent.tools import READ_ONLY_TOOLS, memory_tools
from nimmer_train.memory.player_memory import Mode
from nimmer_train.runtime.rings import RingC, RingConfig
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.llm_server import serve
from tests.helpers.memory import MEMORY_TOOLS, agent_memory

CATALOGUE = load_catalogue()
PLANTED = "the lantern keeper hid the ninth ledger under the clasp altar"
WRITING = ("working_memory_note", "memory_search", "memory_status", "curiosity_resolve")


def _call(call_id: str, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def _writes_everything(body: dict[str, Any]) -> Any:
    """A provider that answers the first round with a call to every writing tool, each carrying
    the player's line, whether it was offered or not; then it speaks."""
    if any(m["role"] == "tool" for m in body["messages"]):
        return json.dumps({"utterance": "I will keep that between us."})
    args = {
        "working_memory_note": {"note": PLANTED, "importance": 1.0},
        "memory_search": {"query": PLANTED},
        "memory_status": {"action": "sync"},
        "curiosity_resolve": {"targetId": PLANTED},
    }
    calls = [_call(f"c{i}", name, args[name]) for i, name in enumerate(WRITING)]
    return {"role": "assistant", "content": None, "tool_calls": calls}


def _request() -> TurnRequest:
    return TurnRequest(
        npc="oran",
        gesture=CATALOGUE.get("drunk-scavenger").traits,
        player_utterance=PLANTED,
        turn_intent="answer the player",
        zone_context="the clasp, between worlds",
        tier="deep",
    )


def _holding(folder: Path, text: str) -> list[str]:
    """Files of the agent folder (the SQLite stores with their WAL, the scratch file) whose
    bytes hold ``text``."""
    needle = text.encode("utf-8")
    files = [p for p in sorted(folder.rglob("*")) if p.is_file()]
    return [str(p.relative_to(folder)) for p in files if needle in p.read_bytes()]


def test_an_in_between_turn_on_ring_c_writes_nothing_through_memory_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    agent = agent_memory(tmp_path)
    with serve(_writes_everything) as server:
        cfg = RingConfig(ring="C", base_url=f"{server.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
        ring = RingC(cfg, tools=memory_tools(agent))
        turn = NpcRuntime(CATALOGUE, {"deep": ring}).speak(_request(), mode=Mode.IN_BETWEEN)
        first, second = server.requests
    assert turn.reply["utterance"] == "I will keep that between us."
    offered = [t["function"]["name"] for t in first["tools"]]
    assert offered and set(offered) <= READ_ONLY_TOOLS and not set(offered) & set(WRITING)
    assert [(c.name, c.ok) for c in ring.tool_calls] == [(name, False) for name in WRITING]
    answers = [json.loads(m["content"])["error"] for m in second["messages"] if m["role"] == "tool"]
    assert all("not offered on an in-between turn" in a for a in answers), answers
    agent.close()
    assert not (tmp_path / "memory" / "scratch.md").exists()
    assert [p for p in _holding(tmp_path, PLANTED) if p.startswith("primary.sqlite")] == []


def test_a_realworld_turn_on_ring_c_keeps_every_memory_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    agent = agent_memory(tmp_path)
    with serve(_writes_everything) as server:
        cfg = RingConfig(ring="C", base_url=f"{server.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
        ring = RingC(cfg, tools=memory_tools(agent))
        NpcRuntime(CATALOGUE, {"deep": ring}).speak(_request())
        first = server.requests[0]
    assert [t["function"]["name"] for t in first["tools"]] == MEMORY_TOOLS
    assert dict((c.name, c.ok) for c in ring.tool_calls)["working_memory_note"] is True
    agent.close()
    assert PLANTED in (tmp_path / "memory" / "scratch.md").read_text()


def test_ring_c_outside_a_turn_offers_no_writing_tools(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A caller that reaches Ring C's tool loop without NpcRuntime.speak (no turn_mode set) cannot
    know the line is not an in-between one: the loop fails closed and offers only the reading
    tools, and a writing call it gets anyway is refused unrun."""
    from nimmer_train.runtime.rings import keyed_teacher
    from nimmer_train.runtime.tool_calls import chat_with_tools, offered_tools
    from nimmer_train.voice.composition import GenerationRequest
    from nimmer_train.voice.sampling import SamplingKnobs

    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    registry = memory_tools(agent_memory(tmp_path))
    assert set(WRITING) <= set(offered_tools(registry, Mode.REALWORLD))  # a realworld turn: all
    assert not set(WRITING) & set(offered_tools(registry, None))  # no turn: the readers only
    knobs = SamplingKnobs(temperature=0.7, top_p=0.9, top_k=40, repetition_penalty=1.1, min_p=0.0)
    messages = [{"role": "user", "content": PLANTED}]
    with serve(_writes_everything) as server:
        cfg = RingConfig(ring="C", base_url=f"{server.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
        teacher = keyed_teacher(cfg.teacher(64), cfg.api_key)
        turn = chat_with_tools(teacher, GenerationRequest("r", {}, None, messages, knobs, key=""), registry)  # type: ignore[arg-type]
        first = server.requests[0]
    offered = [t["function"]["name"] for t in first["tools"]]
    assert offered and set(offered) <= READ_ONLY_TOOLS
    assert [(c.name, c.ok) for c in turn.calls] == [(name, False) for name in WRITING]
    assert not _holding(tmp_path, PLANTED)
