"""Ring C with the memory tools: OpenAI-style tool schemas in the request, tool calls executed in
the turn loop and answered to the provider (the loopback stand-in, tests/helpers/llm_server.py),
bad arguments answered as errors that name the argument."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.tools import memory_tools
from nimmer_train.memory.player_memory import Mode
from nimmer_train.runtime.rings import RingC, RingConfig
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.llm_server import serve
from tests.helpers.memory import MEMORY_TOOLS, agent_memory

CATALOGUE = load_catalogue()


def _call(call_id: str, name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": text}}


def _request() -> TurnRequest:
    return TurnRequest(
        npc="oran",
        gesture=CATALOGUE.get("drunk-scavenger").traits,
        player_utterance="Do you remember where the spare key is?",
        turn_intent="answer the player",
        zone_context="the scrap fields at dusk",
        tier="deep",
    )


def test_ring_c_runs_memory_tool_calls_inside_the_turn(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    agent = agent_memory(tmp_path)
    agent.add([CrystalSpec("The spare key hangs behind the blue door.", "note")])

    def answer(body: dict[str, Any]) -> Any:
        tool_results = [m for m in body["messages"] if m["role"] == "tool"]
        if not tool_results:  # first round: a bad call and a good one
            return {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    _call("c1", "memory_search", {"query": "spare key", "maxResults": "all"}),
                    _call("c2", "memory_search", {"query": "spare key", "maxResults": 2}),
                ],
            }
        if len(tool_results) == 2:  # second round: write a note
            return {
                "role": "assistant",
                "tool_calls": [_call("c3", "working_memory_note", {"note": "asked about the key"})],
            }
        found = json.loads(tool_results[1]["content"])["results"][0]["text"]
        return json.dumps({"utterance": f"Aye. {found}"})

    with serve(answer) as server:
        cfg = RingConfig(ring="C", base_url=f"{server.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
        ring = RingC(cfg, tools=memory_tools(agent))
        turn = NpcRuntime(CATALOGUE, {"deep": ring}).speak(_request())
        first, second, third = server.requests
    assert turn.reply["utterance"] == "Aye. The spare key hangs behind the blue door."
    names = [t["function"]["name"] for t in first["tools"]]
    assert names == MEMORY_TOOLS
    assert first["tool_choice"] == "auto" and first["response_format"] == {"type": "json_object"}
    bad, good = second["messages"][-2:]
    assert bad["tool_call_id"] == "c1" and "argument 'maxResults'" in json.loads(bad["content"])["error"]
    assert good["tool_call_id"] == "c2" and "blue door" in good["content"]
    assert second["messages"][-3]["tool_calls"][0]["id"] == "c1"  # the assistant turn is echoed back
    assert third["messages"][-1]["tool_call_id"] == "c3"
    assert [(c.name, c.ok) for c in ring.tool_calls] == [
        ("memory_search", False),
        ("memory_search", True),
        ("working_memory_note", True),
    ]
    assert (tmp_path / "memory" / "scratch.md").read_text().count("asked about the key") == 1
    assert turn.prompt_tokens == 3 * 40 and turn.completion_tokens == 3 * 12  # summed over the rounds
    agent.close()


def test_a_model_that_keeps_calling_tools_must_answer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    agent = agent_memory(tmp_path)

    def answer(body: dict[str, Any]) -> Any:
        if body["tool_choice"] == "none":
            return json.dumps({"utterance": "Enough searching."})
        return {"role": "assistant", "tool_calls": [_call("c", "memory_status", "{}")]}

    with serve(answer) as server:
        cfg = RingConfig(ring="C", base_url=f"{server.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
        ring = RingC(cfg, tools=memory_tools(agent))
        turn = NpcRuntime(CATALOGUE, {"deep": ring}).speak(_request())
        assert len(server.requests) == 4 and server.requests[-1]["tool_choice"] == "none"
    assert turn.reply["utterance"] == "Enough searching." and len(ring.tool_calls) == 3
    agent.close()


def test_ring_c_refuses_in_between_memory_tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    agent = agent_memory(tmp_path)
    agent.working_memory_note("what she whispered at the clasp", mode=Mode.IN_BETWEEN)
    with serve(lambda body: json.dumps({"utterance": "..."})) as server:
        cfg = RingConfig(ring="C", base_url=f"{server.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
        ring = RingC(cfg, tools=memory_tools(agent, Mode.IN_BETWEEN))
        with pytest.raises(Exception, match="REALWORLD memory tools only"):
            NpcRuntime(CATALOGUE, {"deep": ring}).speak(_request())
        assert server.requests == []  # nothing left the device
    agent.close()
