"""The thin runtime: register selection with hysteresis, structured output, the three rings, and
memory write-back (the per-turn knobs are tested in tests/unit/voice/). ``nimmer serve`` is
exercised with the official ``openai`` client on loopback; Ring C's providers are stood in for by
tests/helpers/llm_server.py (third parties)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import validate

from nimmer_train.errors import ConfigError
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.openai_server import create_app
from nimmer_train.runtime.rings import RingA, RingB, RingC, RingConfig, RingReply, player_rings, word_count
from nimmer_train.runtime.selection import RegisterSelector, SelectionConfig, cosine, vector
from nimmer_train.runtime.turn import NpcRuntime, TurnError, TurnRequest
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, render_compact
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import SamplingKnobs, shape_knobs
from tests.helpers.llm_server import serve
from tests.helpers.loopback import serve_app

CATALOGUE = load_catalogue()
PROFILES = {name: CATALOGUE.get(name).traits for name in CATALOGUE.names}


def _noisy(profile: dict[str, float], noise: list[float]) -> dict[str, float]:
    return {
        axis: max(-1.0, min(1.0, v + n)) for (axis, v), n in zip(sorted(profile.items()), noise, strict=False)
    }


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.floats(-0.05, 0.05), min_size=5, max_size=5), min_size=5, max_size=40))
def test_no_switch_under_noise_below_the_margin(noise: list[list[float]]) -> None:
    selector = RegisterSelector(PROFILES, SelectionConfig(decay=0.8, margin=0.15, patience=3))
    first = selector.update(PROFILES["caste-preacher"])
    assert first == "caste-preacher"
    for step in noise:
        assert selector.update(_noisy(PROFILES["caste-preacher"], step)) == "caste-preacher"
    assert selector.switches == 0


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(CATALOGUE.names), st.sampled_from(CATALOGUE.names), st.integers(1, 5))
def test_a_sustained_change_switches_after_patience(start: str, target: str, patience: int) -> None:
    cfg = SelectionConfig(decay=0.5, margin=0.1, patience=patience)
    selector = RegisterSelector(PROFILES, cfg)
    assert selector.update(PROFILES[start]) == start
    chosen = [selector.update(PROFILES[target]) for _ in range(patience + 12)]
    distinct = 1 - cosine(vector(PROFILES[start]), vector(PROFILES[target])) > cfg.margin
    final = chosen[-1]
    scores = selector.scores()  # the accumulator has settled on the target's profile
    # once settled, nothing beats the register that speaks by more than the margin...
    assert max(scores.values()) - scores[final] <= cfg.margin
    if distinct:  # ...so a start the target beats by more than the margin has been left
        assert final != start and selector.switches >= 1
        assert chosen[: patience - 1] == [start] * (patience - 1)  # never before `patience` turns
    else:
        assert final == start  # close profiles never beat the margin


class ScriptedRing:
    """A ring that answers from a list (the failure path needs exact bad outputs)."""

    name, constrained, context_tokens = "test", False, None
    count = staticmethod(word_count)

    def __init__(self, texts: list[str]) -> None:
        self.texts = texts
        self.calls = 0

    def render(self, prompt, register):  # noqa: ANN001, ANN201
        return render_compact(prompt)

    def speak(self, prompt, register, name, knobs) -> RingReply:  # noqa: ANN001
        self.calls += 1
        return RingReply(self.texts.pop(0), "test")


def _request(**kw: object) -> TurnRequest:
    return TurnRequest(
        npc="oran",
        gesture=PROFILES["drunk-scavenger"],
        player_utterance="Where did the water go?",
        turn_intent="answer the player",
        zone_context="the scrap fields at dusk",
        **kw,
    )


def test_structured_output_retries_once_then_fails_typed() -> None:
    ok = json.dumps({"utterance": "Gone, friend. Drunk by the dunes."})
    ring = ScriptedRing(["not json", ok])
    turn = NpcRuntime(CATALOGUE, {"casual": ring}).speak(_request())
    assert (
        turn.attempts == 2
        and turn.reply["utterance"].startswith("Gone")
        and turn.register == "drunk-scavenger"
    )
    ring = ScriptedRing(['{"utterance": ""}', '{"text": "wrong field"}'])
    with pytest.raises(TurnError) as info:
        NpcRuntime(CATALOGUE, {"casual": ring}).speak(_request())
    assert info.value.kind == "invalid_output" and ring.calls == 2


def test_ring_c_openai_and_anthropic_with_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    answer = lambda body: json.dumps({"utterance": "The gate keeps its own counsel."})  # noqa: E731
    with serve(answer) as server:
        server.script = [(503, {}, "busy"), (429, {"Retry-After": "0"}, "slow down")]
        cfg = RingConfig(
            ring="C",
            base_url=f"{server.url}/v1",
            model="gpt-x",
            api_key_env="PLAYER_KEY",
            price_in_per_mtok=1.0,
            price_out_per_mtok=2.0,
            max_retries=3,
        )
        runtime = NpcRuntime(CATALOGUE, {"deep": RingC(cfg)})
        turn = runtime.speak(_request(tier="deep"))
        sent = server.requests[-1]
        assert len(server.requests) == 3 and turn.reply["utterance"].startswith("The gate")
        assert sent["response_format"] == {"type": "json_object"} and "top_k" not in sent
        assert "You are speaking as" in sent["messages"][0]["content"]  # the projection prompt, no LoRA
        assert any("top_k" in w for w in turn.feature_compat_warnings)
        assert turn.cost_usd == pytest.approx((40 * 1.0 + 12 * 2.0) / 1e6)
        assert server.headers[-1]["Authorization"] == "Bearer sk-player"
        anthropic = RingConfig(
            ring="C", provider="anthropic", base_url=server.url, model="claude-x", api_key_env="PLAYER_KEY"
        )
        turn = NpcRuntime(CATALOGUE, {"deep": RingC(anthropic)}).speak(_request(tier="deep"))
        sent = server.requests[-1]
        assert sent["tool_choice"]["type"] == "tool" and sent["tools"][0]["input_schema"] == TURN_SCHEMA
        assert sent["temperature"] == 1.0 and any("clamped" in w for w in turn.feature_compat_warnings)
        server.script = [(401, {}, "bad key")]
        with pytest.raises(Exception, match="401"):
            NpcRuntime(CATALOGUE, {"deep": RingC(anthropic)}).speak(_request(tier="deep"))
        server.script = ["malformed"] * 2
        with pytest.raises(TurnError) as info:
            NpcRuntime(CATALOGUE, {"deep": RingC(dataclasses.replace(cfg, max_retries=1))}).speak(
                _request(tier="deep")
            )
        assert info.value.kind == "malformed_response"


def test_memory_write_back_goes_where_the_mode_allows(tmp_path: Path) -> None:
    from nimmer_train.memory.player_memory import Mode
    from nimmer_train.memory.sync import open_player
    from tests.helpers.memory import HashEmbedder

    memory, _ = open_player(tmp_path / "player", HashEmbedder())
    lines = ["Ration line moved east.", "I was the one who left the gate open."]
    ring = ScriptedRing([json.dumps({"utterance": line}) for line in lines])
    runtime = NpcRuntime(CATALOGUE, {"casual": ring}, memory=memory)
    runtime.speak(_request())
    runtime.speak(_request(), mode=Mode.IN_BETWEEN)
    primary = [e.text for e in memory.entries()]
    assert lines[0] in primary and lines[1] not in primary
    hits = memory.retrieve(lines[1], k=5, mode=Mode.IN_BETWEEN)
    assert ("clasp", lines[1]) in [(h.store, h.entry.text) for h in hits]


@pytest.fixture(scope="module")
def tiny_model(tiny_run: Path) -> LocalModel:
    return LocalModel.open(tiny_run / "releases", "v1", tiny_run / "keys" / "trusted")


@pytest.mark.slow
def test_openai_client_against_nimmer_serve(tiny_model: LocalModel) -> None:
    import openai

    label = tiny_model.label
    schema = {
        "type": "object",
        "properties": {"line": {"type": "string"}},
        "required": ["line"],
        "additionalProperties": False,
    }
    messages = [
        {"role": "system", "content": '{"role":"a caste-preacher"}'},
        {"role": "user", "content": "Speak."},
    ]
    knobs = {
        "temperature": 0.9,
        "top_p": 0.95,
        "top_k": 40,
        "min_p": 0.02,
        "repetition_penalty": 1.1,
        "no_repeat_ngram_size": 2,  # an extension: it must reach the engine as in-process
    }
    with serve_app(create_app(tiny_model)) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        ids = [m.id for m in client.models.list()]
        assert ids == [label, f"{label}:drunk-scavenger", f"{label}:hivemind-broadcast"]
        for mid in ids:
            register = mid.split(":")[1] if ":" in mid else None
            reply = client.chat.completions.create(
                model=mid,
                messages=messages,
                max_tokens=40,
                seed=7,
                response_format={"type": "json_schema", "json_schema": {"name": "line", "schema": schema}},
                extra_body={k: v for k, v in knobs.items() if k not in ("temperature", "top_p")},
                temperature=knobs["temperature"],
                top_p=knobs["top_p"],
            )
            text = reply.choices[0].message.content
            validate(json.loads(text), schema)
            assert (
                reply.system_fingerprint == f"{label}:{register or 'base'}"
            )  # the adapter followed the name
            same = tiny_model.generate(
                messages, register, SamplingKnobs(**knobs, max_new_tokens=40), schema, seed=7
            )
            assert same.text == text  # the knobs reached generation: identical to Ring A with the same seed
        with pytest.raises(openai.NotFoundError):
            client.chat.completions.create(model=f"{label}:caste-preacher", messages=messages)
        stream = client.chat.completions.create(
            model=ids[-1], messages=messages, max_tokens=40, seed=7, stream=True, extra_body={"top_k": 40}
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        whole = client.chat.completions.create(
            model=ids[-1], messages=messages, max_tokens=40, seed=7, extra_body={"top_k": 40}
        )
        assert streamed == whole.choices[0].message.content  # streaming is the same decode, in chunks


@pytest.mark.slow
def test_ring_a_and_ring_b_speak_valid_turns_per_register(tiny_model: LocalModel) -> None:
    registers = tiny_model.registers
    with serve_app(create_app(tiny_model)) as url:
        rings = {"casual": RingA(tiny_model), "deep": RingB(RingConfig(ring="B", base_url=f"{url}/v1"))}
        runtime = NpcRuntime(CATALOGUE, rings, registers=registers, max_new_tokens=48)
        for register in registers:
            for tier in ("casual", "deep"):
                turn = runtime.speak(
                    dataclasses.replace(_request(tier=tier), npc=register, gesture=PROFILES[register])
                )
                validate(turn.reply, TURN_SCHEMA)
                assert (turn.register, turn.adapter, turn.attempts) == (register, register, 1)
                shaped = shape_knobs(CATALOGUE, register, PROFILES[register], 0.5, 0.0, max_new_tokens=48)
                assert turn.knobs == shaped.knobs.as_dict()


@pytest.mark.slow
def test_nimmer_serve_runs_as_a_process_over_a_verified_version(tiny_run: Path) -> None:
    import httpx

    from nimmer_train.runtime.stage import serve_process

    with serve_process(tiny_run / "releases", "candidate", tiny_run / "keys" / "trusted") as url:
        ids = [m["id"] for m in httpx.get(f"{url}/models").json()["data"]]
    # v2 has the hivemind-broadcast federated adapter merged into its weights: no LoRA for it
    assert ids == ["nimmerworld-base-v2", "nimmerworld-base-v2:drunk-scavenger"]


def test_player_llm_config_puts_tiers_in_different_rings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    with serve(lambda body: json.dumps({"utterance": "Noted, citizen."})) as server:
        row = {
            "casual_tier_ring": "C_external",
            "casual_tier_provider": "anthropic",
            "casual_tier_endpoint": server.url,
            "casual_tier_model": "claude-x",
            "casual_tier_credentials_ref": "PLAYER_KEY",
            "deep_tier_ring": "C_external",
            "deep_tier_endpoint": f"{server.url}/v1",
            "deep_tier_model": "gpt-x",
        }
        rings, warnings = player_rings(row)
        assert warnings["casual_tier"] == [
            "multi_lora_emulated_via_prompt",
            "top_p_unsupported_dropped",
            "repetition_penalty_unsupported_dropped",
            "min_p_unsupported_dropped",
        ]
        runtime = NpcRuntime(CATALOGUE, rings)
        assert runtime.speak(_request(tier="casual")).reply == {"utterance": "Noted, citizen."}
        assert runtime.speak(_request(tier="deep")).ring == "C"
        assert [("tools" in r) for r in server.requests] == [
            True,
            False,
        ]  # anthropic tool use, then OpenAI JSON mode
    with pytest.raises(ConfigError, match="A_local needs the local model"):
        player_rings({"casual_tier_ring": "A_local"})
    with pytest.raises(ConfigError, match="casual_tier_ring"):
        player_rings({"casual_tier_ring": "D_moon"})
