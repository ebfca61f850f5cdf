"""The register catalogue, the prompt DSL (both renderers, validation, round trips) and the
composition spec."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimmer_train.errors import NimmerError
from nimmer_train.voice.composition import expand
from nimmer_train.voice.prompt_dsl import (
    TURN_SCHEMA,
    AffectState,
    MemoryScope,
    PromptError,
    ReplyError,
    TurnPrompt,
    parse_compact,
    render_compact,
    render_projection,
    validate_reply,
)
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import baseline
from nimmer_train.voice.traits import TRAIT_AXES
from pipelines.entry import precheck
from tests.helpers.compose import composition

CATALOGUE = load_catalogue()


def test_catalogue_has_the_v1_registers_with_design_sampling() -> None:
    assert CATALOGUE.names == [
        "caste-preacher",
        "drunk-scavenger",
        "clasp-confession",
        "hivemind-broadcast",
        "imperial-ceremony-chorus",
    ]
    table = {
        name: (baseline(CATALOGUE, name).temperature, baseline(CATALOGUE, name).top_p)
        for name in CATALOGUE.names
    }
    assert table == {
        "caste-preacher": (0.3, 0.6),
        "drunk-scavenger": (1.1, 0.95),
        "clasp-confession": (0.85, 0.92),
        "hivemind-broadcast": (0.2, 0.5),
        "imperial-ceremony-chorus": (0.25, 0.55),
    }
    for name in CATALOGUE.names:
        reg = CATALOGUE.get(name)
        assert set(reg.traits) == set(TRAIT_AXES) and reg.literary_affinities and len(reg.exemplars) >= 3
    with pytest.raises(NimmerError, match="unknown register 'bard'.*caste-preacher"):
        CATALOGUE.get("bard")


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("composition.registers=[bard]", "composition.registers: unknown register 'bard'"),
        ("+registers.catalogue.caste-preacher.traits.Eros=0.5", "unknown trait axis 'Eros'"),
        ("registers.catalogue.caste-preacher.traits.Sophrosyne=1.5", "outside [-1, 1]"),
        ("registers.catalogue.caste-preacher.literary_affinities=[ulysses]", "no corpus work 'ulysses'"),
    ],
)
def test_unknown_names_in_config_fail_naming_them(override: str, expected: str, capsys) -> None:
    with pytest.raises(SystemExit):
        precheck([override])
    assert expected in capsys.readouterr().err


def _prompt(**kw) -> TurnPrompt:
    base = dict(
        role="a caste-preacher",
        trait_vector={"Sophrosyne": 0.8, "Aletheia": -0.3},
        affect_state=AffectState("stern", -0.2, 0.4),
        memory_scope=MemoryScope(items=("a memory",)),
        turn_intent="warn",
        zone_context="the cistern",
        player_utterance="Why?",
    )
    return TurnPrompt(**{**base, **kw})


def test_projection_renders_every_field() -> None:
    system, user = render_projection(_prompt(), CATALOGUE.get("caste-preacher"))
    text = system["content"]
    for needle in (
        "You are speaking as a caste-preacher",
        "- Sophrosyne +0.80 (strongly composed",
        "- Aletheia -0.30 (mildly concealing",
        "register: sermonic",
        "Affect: stern",
        "Current scene: the cistern",
        "- a memory",
        "Turn intent: warn",
        "Respond in JSON matching: " + json.dumps(TURN_SCHEMA, separators=(",", ":")),
    ):
        assert needle in text
    assert user == {"role": "user", "content": "Why?"}


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"trait_vector": {"Eros": 0.1}}, "unknown trait axis 'Eros'"),
        ({"trait_vector": {"Sophrosyne": 2.0}}, "outside [-1, 1]"),
        ({"turn_intent": " "}, "turn_intent"),
        ({"affect_state": AffectState("x", 0.0, 1.5)}, "affect_state"),
        ({"memory_scope": MemoryScope(layers=("dreams",))}, "memory_scope.layers"),
        ({"output_schema": {"type": "banana"}}, "output_schema"),
    ],
)
def test_invalid_prompts_name_the_field(kw: dict, field: str) -> None:
    with pytest.raises(PromptError, match=field.replace("[", r"\[")):
        _prompt(**kw)


def test_reply_validation() -> None:
    assert validate_reply('{"utterance": "Go."}', TURN_SCHEMA) == {"utterance": "Go."}
    assert validate_reply('```json\n{"utterance": "Go."}\n```', TURN_SCHEMA) == {"utterance": "Go."}
    for text, reason in (
        ("", "empty"),
        ("Go.", "not_json"),
        ('{"utterance": ""}', "schema"),
        ('{"utterance": "Go.", "x": 1}', "schema"),
        ("[1]", "schema"),
    ):
        with pytest.raises(ReplyError) as err:
            validate_reply(text, TURN_SCHEMA)
        assert err.value.reason == reason


words = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=40)
prompts = st.builds(
    TurnPrompt,
    role=words.filter(str.strip),
    trait_vector=st.dictionaries(st.sampled_from(TRAIT_AXES), st.floats(-1, 1, allow_nan=False)),
    affect_state=st.builds(AffectState, words, st.floats(-1, 1), st.floats(0, 1)),
    memory_scope=st.builds(
        MemoryScope,
        st.lists(st.sampled_from(["world", "district", "primary", "clasp"]), max_size=4).map(tuple),
        st.lists(words, max_size=3).map(tuple),
    ),
    turn_intent=words.filter(str.strip),
    zone_context=words.filter(str.strip),
    output_schema=st.just(TURN_SCHEMA)
    | st.just({"type": "object", "required": ["line"], "properties": {"line": {"type": "string"}}}),
    player_utterance=st.text(max_size=60),
)


@settings(max_examples=150, deadline=None)
@given(prompts)
def test_every_valid_prompt_renders_and_round_trips(prompt: TurnPrompt) -> None:
    assert parse_compact(render_compact(prompt)) == prompt
    assert TurnPrompt.from_dict(json.loads(json.dumps(prompt.to_dict()))) == prompt
    for register in (None, CATALOGUE.get("drunk-scavenger")):
        system = render_projection(prompt, register)[0]["content"]
        assert prompt.turn_intent in system and prompt.zone_context in system
        assert all(f"{axis} {value:+.2f}" in system for axis, value in prompt.trait_vector.items())


def test_composition_expands_deterministically() -> None:
    spec = composition()
    requests = expand(spec, CATALOGUE)
    assert len(requests) == 5 * 2 * 6 * 4 * 2 and len({r.key for r in requests}) == len(requests)
    assert [r.key for r in expand(spec, CATALOGUE)] == [r.key for r in requests]
    first = requests[0]
    assert set(first.tags) == {"register", "jitter", "scene", "turn_intent", "zone"}
    assert first.prompt.trait_vector != CATALOGUE.get(first.register).traits  # jittered
    sampled = expand(composition("composition.per_register=5"), CATALOGUE)
    assert len(sampled) == 25 and {r.key for r in sampled} <= {r.key for r in requests}
    other_seed = expand(composition("composition.seed=1"), CATALOGUE)
    assert {r.key for r in other_seed}.isdisjoint({r.key for r in requests})
