"""The runtime follows the design's rules (issue 26; seeds/inference-and-memory-architecture.txt):
the Tier x Ring matrix, the hivemind through Anthropic via us, deep-tier routing and the clasp
rule (issue 17) winning over it, provider profiles in Ring C, and per-turn director overrides.
Providers are third parties: tests/helpers/llm_server.py stands in for each wire format on loopback."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimmer_train.config import providers
from nimmer_train.config.providers import HIVEMIND_KEY_ENV, ProviderProfile
from nimmer_train.errors import ConfigError, NimmerError
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from nimmer_train.memory.sync import open_player
from nimmer_train.runtime.rings import RingC, RingConfig, RingReply, player_rings, word_count
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.prompt_dsl import render_compact
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import GUARDS, SamplingKnobs, bounds
from tests.helpers.llm_server import serve
from tests.helpers.memory import HashEmbedder

CATALOGUE = load_catalogue()
REPLY = json.dumps({"utterance": "So it is."})


class RecordingRing:
    """A ring that answers REPLY and records the knobs and prompts it was given."""

    constrained, context_tokens = False, None
    count = staticmethod(word_count)

    def __init__(self, name: str, local: bool = False) -> None:
        self.name, self.local = name, local
        self.knobs: list[SamplingKnobs] = []
        self.prompts: list[Any] = []

    def render(self, prompt, register):  # noqa: ANN001, ANN201
        return render_compact(prompt)

    def speak(self, prompt, register, name, knobs) -> RingReply:  # noqa: ANN001
        self.knobs.append(knobs)
        self.prompts.append(prompt)
        return RingReply(REPLY, self.name)


class FakeLocal:  # RingA only reads ``context_tokens`` at construction
    context_tokens = None


def _request(register: str, **kw: Any) -> TurnRequest:
    kw.setdefault("npc", "npc-1")
    return TurnRequest(
        gesture=CATALOGUE.get(register).traits,
        player_utterance="Speak.",
        turn_intent="answer",
        zone_context="the gate",
        **kw,
    )


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[PlayerMemory]:
    memory, _ = open_player(tmp_path / "player", HashEmbedder())
    memory.write("CLASP-SECRET the ribbon in my boot", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    yield memory
    memory.close()


# --- Tier x Ring matrix ---
def test_a_deep_tier_turn_on_ring_a_is_refused_at_config_time() -> None:
    with pytest.raises(ConfigError, match=r"deep_tier_ring.*not allowed for the deep tier.*allowed: B, C"):
        player_rings({"deep_tier_ring": "A_local"}, local=FakeLocal())
    rings, _ = player_rings({"casual_tier_ring": "A_local"}, local=FakeLocal())
    assert rings["casual"].local is True  # the casual tier may run anywhere


def test_the_hivemind_speaks_through_anthropic_via_us_with_our_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    monkeypatch.setenv(HIVEMIND_KEY_ENV, "sk-ours")
    with serve(lambda body: REPLY) as server:
        row = {
            "casual_tier_ring": "C_external",
            "casual_tier_endpoint": f"{server.url}/v1",
            "casual_tier_model": "gpt-x",
            "casual_tier_credentials_ref": "PLAYER_KEY",
            "hivemind_tier_model": "claude-x",
            "hivemind_tier_endpoint": server.url,
        }
        rings, _ = player_rings(row)
        runtime = NpcRuntime(CATALOGUE, rings)
        runtime.speak(_request("hivemind-broadcast"))
        runtime.speak(_request("drunk-scavenger", npc="npc-2"))
    hivemind, casual = server.headers
    assert hivemind.get("x-api-key") == "sk-ours" and "tools" in server.requests[0]  # Anthropic wire
    assert "sk-player" not in json.dumps(hivemind)
    assert casual.get("Authorization") == "Bearer sk-player" and "tools" not in server.requests[1]
    with pytest.raises(ConfigError, match="hivemind_tier_provider"):
        player_rings({**row, "hivemind_tier_provider": "openai"})


def test_clasp_confession_and_the_in_between_are_routed_to_the_deep_tier() -> None:
    casual, deep = RecordingRing("B"), RecordingRing("C")
    runtime = NpcRuntime(CATALOGUE, {"casual": casual, "deep": deep})
    assert runtime.speak(_request("clasp-confession")).ring == "C"
    assert runtime.speak(_request("caste-preacher", npc="npc-2")).ring == "B"
    turn = runtime.speak(_request("caste-preacher", npc="npc-3"), mode="in_between")
    assert turn.ring == "C" and len(deep.knobs) == 2 and len(casual.knobs) == 1
    # no deep tier configured: the casual ring serves, nothing to report
    only = NpcRuntime(CATALOGUE, {"casual": RecordingRing("B")})
    assert only.speak(_request("clasp-confession")).feature_compat_warnings == []


def test_the_clasp_rule_wins_over_deep_routing_and_the_conflict_is_reported(memory: PlayerMemory) -> None:
    local, deep = RecordingRing("A", local=True), RecordingRing("C")
    runtime = NpcRuntime(CATALOGUE, {"casual": local, "deep": deep}, memory=memory)
    turn = runtime.speak(_request("clasp-confession"), mode=Mode.IN_BETWEEN)
    assert turn.ring == "A" and deep.knobs == []
    assert "deep_tier_routing_refused_clasp_stays_on_ring_A" in turn.feature_compat_warnings
    assert "CLASP-SECRET" in json.dumps(local.prompts[0].memory_scope.items, default=str)
    # realworld clasp-confession: no clasp text, no conflict -> the deep tier
    assert runtime.speak(_request("clasp-confession")).ring == "C"


# --- Provider profiles (Ring C) ---
def test_a_provider_without_top_k_drops_it_with_the_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    with serve(lambda body: REPLY) as server:
        for provider in ("openai", "openai_compatible"):
            cfg = RingConfig(
                ring="C", provider=provider, base_url=f"{server.url}/v1", model="m", api_key_env="PLAYER_KEY"
            )
            turn = NpcRuntime(CATALOGUE, {"casual": RingC(cfg)}).speak(_request("drunk-scavenger"))
            sent = server.requests[-1]
            assert (
                "top_k" not in sent
                and "min_p" not in sent
                and sent["response_format"]["type"] == "json_object"
            )
            assert "top_k_unsupported_dropped" in turn.feature_compat_warnings
            assert "multi_lora_emulated_via_prompt" in turn.feature_compat_warnings


def test_a_provider_with_every_knob_gets_them_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    with serve(lambda body: REPLY) as server:
        cfg = RingConfig(
            ring="C", provider="together", base_url=f"{server.url}/v1", model="m", api_key_env="PLAYER_KEY"
        )
        turn = NpcRuntime(CATALOGUE, {"casual": RingC(cfg)}).speak(_request("drunk-scavenger"))
    sent = server.requests[-1]
    assert {"top_k", "repetition_penalty", "min_p"} <= set(sent) and sent["top_k"] == turn.knobs["top_k"]
    # the design's knobs all arrive; only the project's two guards, which no provider's API has, are dropped
    dropped = [w for w in turn.feature_compat_warnings if "dropped" in w or "multi_lora" in w]
    assert dropped == [f"{g}_unsupported_dropped" for g in GUARDS] and not set(GUARDS) & set(sent)


def test_a_temperature_beyond_the_providers_range_is_clamped_with_the_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    with serve(lambda body: REPLY) as server:
        cfg = RingConfig(
            ring="C", provider="anthropic", base_url=server.url, model="c", api_key_env="PLAYER_KEY"
        )
        request = _request("drunk-scavenger", director={"temperature": 1.3})
        turn = NpcRuntime(CATALOGUE, {"casual": RingC(cfg)}).speak(request)
    sent = server.requests[-1]
    assert sent["temperature"] == 1.0 and "temperature_1.3_clamped_to_1.0" in turn.feature_compat_warnings
    assert "top_p" not in sent and "top_p_unsupported_dropped" in turn.feature_compat_warnings
    assert sent["tool_choice"]["type"] == "tool"  # the profile's structured mode: a forced tool call


def test_adding_a_provider_is_adding_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    row = ProviderProfile(
        "openai_compatible", ("temperature", "top_p", "top_k", "min_p"), "json_mode", False, (0.0, 1.5), None
    )
    monkeypatch.setitem(providers.PROFILES, "moonshot", row)
    monkeypatch.setenv("PLAYER_KEY", "sk-player")
    with serve(lambda body: REPLY) as server:
        cfg = RingConfig(
            ring="C", provider="moonshot", base_url=f"{server.url}/v1", model="m", api_key_env="PLAYER_KEY"
        )
        turn = NpcRuntime(CATALOGUE, {"casual": RingC(cfg)}).speak(_request("drunk-scavenger"))
    assert "top_k" in server.requests[-1]
    assert "repetition_penalty_unsupported_dropped" in turn.feature_compat_warnings
    with pytest.raises(ConfigError, match="unknown provider 'nowhere'"):
        providers.profile("nowhere")


# --- Director overrides ---
def test_a_director_override_within_the_registers_bounds_is_applied_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ring = RecordingRing("B")
    runtime = NpcRuntime(CATALOGUE, {"casual": ring})
    plain = runtime.speak(_request("caste-preacher"))
    with caplog.at_level("INFO", logger="nimmer_train.runtime.turn"):
        turn = runtime.speak(_request("caste-preacher", director={"temperature": 0.5, "top_k": 15}))
    assert ring.knobs[-1].temperature == 0.5 and ring.knobs[-1].top_k == 15
    assert turn.knobs["temperature"] == 0.5 and plain.director_overrides == {}
    assert turn.director_overrides == {
        "temperature": {"from": plain.knobs["temperature"], "to": 0.5},
        "top_k": {"from": plain.knobs["top_k"], "to": 15},
    }
    assert "director overrides" in caplog.text


def test_a_director_override_outside_the_registers_bounds_is_refused() -> None:
    ring = RecordingRing("B")
    runtime = NpcRuntime(CATALOGUE, {"casual": ring})
    low, high = bounds(CATALOGUE, "hivemind-broadcast")["temperature"]
    assert low <= 0.2 <= high < 1.1  # the hivemind cannot be made to sound like a drunk scavenger
    with pytest.raises(NimmerError, match=r"temperature=1.1 is outside register 'hivemind-broadcast'"):
        runtime.speak(_request("hivemind-broadcast", director={"temperature": 1.1}))
    with pytest.raises(NimmerError, match="'seed': not a sampling knob"):
        runtime.speak(_request("hivemind-broadcast", director={"seed": 3}))
    assert ring.knobs == []  # refused before anything was generated
