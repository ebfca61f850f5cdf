"""Ring B stays swappable (issue 18, item 4): the client side of a vLLM farm started with
``--enable-lora`` and ``<version>:<register>`` LoRA module names, against a loopback stand-in
(tests/helpers/llm_server.py: vLLM itself cannot run here). Ring B picks the register's LoRA by
model id, falls back to the base id for a register merged into the weights, and sends every
knob and the schema as vLLM's OpenAI server accepts them."""

from __future__ import annotations

import json

from nimmer_train.runtime.rings import RingB, RingConfig
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.llm_server import serve

CATALOGUE = load_catalogue()
LABEL = "nimmerworld-base-v3"


def _request(register: str) -> TurnRequest:
    return TurnRequest(
        npc=f"npc-{register}",
        gesture=CATALOGUE.get(register).traits,
        player_utterance="What news?",
        turn_intent="answer",
        zone_context="the gate",
        tier="deep",
    )


def test_ring_b_speaks_to_a_vllm_farm_by_model_id() -> None:
    models = [LABEL, f"{LABEL}:drunk-scavenger", f"{LABEL}:caste-preacher"]  # hivemind merged into v3
    with serve(lambda body: json.dumps({"utterance": "Heard."}), models=models) as farm:
        ring = RingB(RingConfig(ring="B", base_url=f"{farm.url}/v1"))
        runtime = NpcRuntime(CATALOGUE, {"deep": ring}, registers=["drunk-scavenger", "hivemind-broadcast"])
        turn = runtime.speak(_request("drunk-scavenger"))
        sent = farm.requests[-1]
        assert sent["model"] == f"{LABEL}:drunk-scavenger" and turn.adapter == "drunk-scavenger"
        assert {"temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_tokens"} <= set(sent)
        assert sent["no_repeat_ngram_size"] == 6  # the guard, by HF's name (vLLM logs and ignores it)
        assert sent["response_format"]["json_schema"]["schema"] == TURN_SCHEMA
        turn = runtime.speak(_request("hivemind-broadcast"))
        assert farm.requests[-1]["model"] == LABEL and turn.adapter is None  # the base carries it
        assert len(farm.requests) == 2  # /v1/models once (a GET), then one chat per turn
