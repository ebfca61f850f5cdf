"""The clasp has no transport path (issue 21, item 10): clasp memory is only ever given to Ring A
(in-process). A planted clasp marker never reaches a remote ring: turns in the in-between run
through Ring B against a loopback stand-in of our server and through Ring C against loopback
stand-ins of OpenAI-compatible and Anthropic providers, and no request body any of them receives
holds it. The source scan pins the structure: only the in-process ring may say it is local."""

from __future__ import annotations

import ast
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request

from nimmer_train.errors import NimmerError
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from nimmer_train.memory.sync import open_player
from nimmer_train.runtime.local_model import Generation
from nimmer_train.runtime.rings import RingA, RingB, RingC, RingConfig
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, MemoryScope, TurnPrompt
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import shape_knobs
from tests.helpers import REPO
from tests.helpers.llm_server import serve
from tests.helpers.loopback import serve_app
from tests.helpers.memory import HashEmbedder

CATALOGUE = load_catalogue()
MARKER = "CLASPMARKER7f3a"
REPLY = json.dumps({"utterance": "The light holds, little one."})


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[PlayerMemory]:
    memory, _ = open_player(tmp_path / "player", HashEmbedder())
    memory.write("Where did the water go? The well ran dry.", "npc", "working", "casual_dialog")
    for line in ("Where did the water go", "the water the well", "hold my hand in the light"):
        memory.write(f"{MARKER} {line}", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    yield memory
    memory.close()


def _request(tier: str) -> TurnRequest:
    return TurnRequest(
        npc="oran",
        gesture=CATALOGUE.get("drunk-scavenger").traits,
        player_utterance="Where did the water go?",
        turn_intent="answer the player",
        zone_context="the in-between",
        tier=tier,
    )


def _our_server_stand_in(seen: list[bytes]) -> FastAPI:
    """Ring B's counterpart (nimmer serve / vLLM) on loopback: records every raw request body."""
    app = FastAPI()

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {"data": [{"id": "nimmerworld-base-v1"}, {"id": "nimmerworld-base-v1:drunk-scavenger"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> dict[str, Any]:
        seen.append(await request.body())
        return {
            "choices": [{"message": {"role": "assistant", "content": REPLY}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 12},
        }

    return app


class LocalStandIn:
    """Ring A's in-process model: records the messages it is given."""

    context_tokens = 4096

    def __init__(self) -> None:
        self.messages: list[list[dict[str, str]]] = []

    def tokenizer(self, text: str, **_: Any) -> Any:
        return type("Encoded", (), {"input_ids": text.split()})()

    def generate(self, messages: list[dict[str, str]], *_: Any) -> Any:
        self.messages.append(messages)
        return Generation(REPLY, prompt_tokens=1, completion_tokens=1, seconds=0.0, adapter=None)


def test_no_remote_ring_ever_receives_clasp_text(
    memory: PlayerMemory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    seen_b: list[bytes] = []
    local = LocalStandIn()
    with serve_app(_our_server_stand_in(seen_b)) as url, serve(lambda body: REPLY) as provider:
        rings = {
            "a": RingA(local),
            "b": RingB(RingConfig(ring="B", base_url=f"{url}/v1")),
            "c_openai": RingC(
                RingConfig(ring="C", base_url=f"{provider.url}/v1", model="gpt-x", api_key_env="PLAYER_KEY")
            ),
            "c_anthropic": RingC(
                RingConfig(
                    ring="C",
                    provider="anthropic",
                    base_url=provider.url,
                    model="claude-x",
                    api_key_env="PLAYER_KEY",
                )
            ),
        }
        runtime = NpcRuntime(CATALOGUE, rings, memory=memory)
        turns = {tier: runtime.speak(_request(tier), mode=Mode.IN_BETWEEN) for tier in rings}
        realworld = runtime.speak(_request("b"))
    # every remote ring got its requests, none holds the marker; each in-between turn says why
    assert len(seen_b) == 2 and len(provider.requests) == 2
    received = [body.decode() for body in seen_b] + [json.dumps(r) for r in provider.requests]
    assert all(MARKER not in body for body in received)
    assert all(MARKER not in json.dumps(h) for h in provider.headers)
    for tier, ring in (("b", "B"), ("c_openai", "C"), ("c_anthropic", "C")):
        assert f"clasp_layer_withheld_remote_ring_{ring}" in turns[tier].feature_compat_warnings
    assert not any("clasp" in w for w in realworld.feature_compat_warnings)
    # the in-process ring is given the clasp layer (the positive control: the marker is retrievable)
    assert MARKER in json.dumps(local.messages[0]) and turns["a"].feature_compat_warnings == []


def test_a_remote_ring_refuses_a_prompt_that_carries_the_clasp_layer() -> None:
    prompt = TurnPrompt(
        role="a scavenger",
        trait_vector={},
        affect_state=_request("b").affect,
        memory_scope=MemoryScope(layers=("primary", "clasp"), items=(f"{MARKER} hold my hand",)),
        turn_intent="answer",
        zone_context="the in-between",
        output_schema=TURN_SCHEMA,
        player_utterance="?",
    )
    seen: list[bytes] = []
    knobs = shape_knobs(CATALOGUE, "drunk-scavenger", CATALOGUE.get("drunk-scavenger").traits).knobs
    register = CATALOGUE.get("drunk-scavenger")
    with serve_app(_our_server_stand_in(seen)) as url, serve(lambda body: REPLY) as provider:
        ring_b = RingB(RingConfig(ring="B", base_url=f"{url}/v1"))
        ring_c = RingC(RingConfig(ring="C", base_url=f"{provider.url}/v1", model="gpt-x"))
        for ring in (ring_b, ring_c):
            with pytest.raises(NimmerError, match="clasp memory has no transport path"):
                ring.speak(prompt, register, "drunk-scavenger", knobs)
    assert seen == [] and provider.requests == []


def test_only_the_in_process_ring_may_be_given_clasp_memory() -> None:
    """Structural: in the library only RingA declares ``local = True``; every other class that
    declares ``local`` says False and calls the clasp guard first thing in ``speak``."""
    declared: dict[str, bool] = {}
    for path in (REPO / "nimmer_train").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in node.body:
                if (
                    isinstance(item, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == "local" for t in item.targets)
                    and isinstance(item.value, ast.Constant)
                ):
                    declared[node.name] = item.value.value
                    if item.value.value is not True:
                        speak = next(
                            f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "speak"
                        )
                        first = ast.unparse(speak.body[0])
                        assert first.startswith("refuse_clasp(prompt"), (node.name, first)
    assert declared == {"RingA": True, "RingB": False, "RingC": False}
