"""The conversation so far in the prompt DSL (issue 40): chat turns between the system message and
the player's line in both renderings, read back exactly; memory items with their dates."""

from __future__ import annotations

import json

import pytest

from nimmer_train.voice.prompt_dsl import (
    NPC,
    PLAYER,
    AffectState,
    MemoryScope,
    PromptError,
    TurnPrompt,
    memory_item,
    parse_compact,
    render_compact,
    render_projection,
    render_reply,
)
from nimmer_train.voice.registers import load_catalogue

CATALOGUE = load_catalogue()
HISTORY = ((PLAYER, "My sister is called Ilse."), (NPC, 'Ilse, then. A "keeper" of bees?'))


def _prompt(conversation: tuple[tuple[str, str], ...] = HISTORY) -> TurnPrompt:
    return TurnPrompt(
        role="a scavenger",
        trait_vector=dict(CATALOGUE.get("drunk-scavenger").traits),
        affect_state=AffectState("wary"),
        memory_scope=MemoryScope(
            items=(memory_item("The gate opens at dawn.", 1_800_000_000.0, "the player"),)
        ),
        turn_intent="answer",
        zone_context="dusk",
        player_utterance="What was her name?",
        conversation=conversation,
    )


def test_both_renderings_put_the_conversation_between_system_and_the_players_line() -> None:
    prompt = _prompt()
    for messages in (render_compact(prompt), render_projection(prompt)):
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
        assert messages[1]["content"] == HISTORY[0][1] and messages[-1]["content"] == "What was her name?"
        assert messages[2]["content"] == render_reply({"utterance": HISTORY[1][1]})  # the one reply form
        assert "Ilse" not in messages[0]["content"]  # the history is not repeated in the system message
    assert parse_compact(render_compact(prompt)) == prompt


def test_an_empty_conversation_renders_as_before() -> None:
    messages = render_compact(_prompt(()))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert "conversation" not in json.loads(messages[0]["content"])  # the trained format, unchanged


def test_a_conversation_line_with_an_unknown_speaker_is_refused() -> None:
    with pytest.raises(PromptError, match=r"conversation\[0\]"):
        _prompt((("narrator", "It rained."),))


def test_memory_items_carry_their_date_and_speaker() -> None:
    assert memory_item("The gate opens at dawn.", 1_800_000_000.0, "the player") == (
        "[2027-01-15 08:00] the player: The gate opens at dawn."
    )
    assert memory_item("Rain.", 0.0) == "[1970-01-01 00:00] Rain."
