"""The structured prompt DSL: one NPC turn as role, trait_vector, affect_state, memory_scope,
turn_intent, zone_context and output_schema, and its two renderings.

- :func:`render_compact`: chat messages for a model that carries the register LoRA (the system
  message is the DSL as compact JSON, so :func:`parse_compact` reads it back exactly).
- :func:`render_projection`: the design's degradation path for models without LoRAs: the trait
  vector projected into a system message ("You are speaking as ... Respond in JSON matching").

Both put the conversation so far (``TurnPrompt.conversation``: the last turns, verbatim, oldest
first) between the system message and the player's line, as chat turns: the player's lines as
``user`` messages, the NPC's as ``assistant`` messages in the one reply form; so every ring, with a
LoRA or without, sees the same history. Memory items carry their date (:func:`memory_item`).

A reply (one NPC turn) has one text form, :func:`render_reply`: properties in the schema's order,
``json.dumps``' default separators ``", "`` and ``": "``, no ASCII escaping. Training targets are
rendered with it, the runtime grammar accepts exactly it (:data:`REPLY_GRAMMAR_OPTIONS`), and
:func:`validate_reply` reads it back unchanged.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from nimmer_train.voice.registers import Register
from nimmer_train.voice.traits import TRAIT_AXES, check_vector, describe

MEMORY_LAYERS = ("world", "district", "primary", "clasp")

TURN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "utterance": {"type": "string", "minLength": 1},
        "emotion": {"type": "string"},
        "gesture": {"type": "string"},
    },
    "required": ["utterance"],
    "additionalProperties": False,
}


ITEM_SEPARATOR, KEY_SEPARATOR = ", ", ": "  # json.dumps' defaults: the one reply format
# llguidance's JSON compile options for exactly that format (no free whitespace)
REPLY_GRAMMAR_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ITEM_SEPARATOR,
    "key_separator": KEY_SEPARATOR,
}


class PromptError(ValueError):
    """A DSL object that breaks the schema; the message names the field."""


PLAYER, NPC = "player", "npc"  # the speakers of a conversation line


def memory_item(text: str, at: float, speaker: str | None = None) -> str:
    """A remembered line as the prompt shows it: its date (UTC, to the minute) first, so an NPC can
    answer "when", then who said it (when known) and the words."""
    when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(at))
    return f"[{when}] {speaker}: {text}" if speaker else f"[{when}] {text}"


class ReplyError(ValueError):
    """A reply that does not satisfy the turn's output_schema; ``reason`` classifies it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class AffectState:
    mood: str  # one word or short phrase: "wary", "grieving"
    valence: float = 0.0  # [-1, 1]
    arousal: float = 0.5  # [0, 1]


@dataclass(frozen=True)
class MemoryScope:
    layers: tuple[str, ...] = ("world", "district", "primary")  # knowledge-stack layers in reach
    items: tuple[str, ...] = ()  # remembered lines put before the model


@dataclass(frozen=True)
class TurnPrompt:
    role: str
    trait_vector: dict[str, float]
    affect_state: AffectState
    memory_scope: MemoryScope
    turn_intent: str
    zone_context: str
    output_schema: dict[str, Any] = field(default_factory=lambda: dict(TURN_SCHEMA))
    player_utterance: str = ""
    # the last turns of this conversation, oldest first, as (PLAYER or NPC, words); the runtime
    # keeps it within the ring's context (runtime/conversation.py)
    conversation: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        for name in ("role", "turn_intent", "zone_context"):
            if not str(getattr(self, name)).strip():
                raise PromptError(f"{name}: must not be empty")
        for i, line in enumerate(self.conversation):
            if len(line) != 2 or line[0] not in (PLAYER, NPC) or not isinstance(line[1], str):
                raise PromptError(f"conversation[{i}]: must be ({PLAYER!r} or {NPC!r}, text), got {line!r}")
        try:
            check_vector(self.trait_vector, "trait_vector")
        except ValueError as exc:
            raise PromptError(str(exc)) from exc
        affect = self.affect_state
        if not -1.0 <= affect.valence <= 1.0 or not 0.0 <= affect.arousal <= 1.0:
            raise PromptError(f"affect_state: valence in [-1, 1] and arousal in [0, 1], got {affect}")
        unknown = [layer for layer in self.memory_scope.layers if layer not in MEMORY_LAYERS]
        if unknown:
            raise PromptError(f"memory_scope.layers: unknown {unknown}; known: {', '.join(MEMORY_LAYERS)}")
        try:
            Draft202012Validator.check_schema(self.output_schema)
        except SchemaError as exc:
            raise PromptError(f"output_schema: not a valid JSON Schema ({exc.message})") from exc

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["memory_scope"] = {k: list(v) for k, v in data["memory_scope"].items()}
        data["conversation"] = [list(line) for line in self.conversation]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TurnPrompt:
        scope = data.get("memory_scope", {})
        return cls(
            role=data["role"],
            trait_vector={k: float(v) for k, v in data["trait_vector"].items()},
            affect_state=AffectState(**data["affect_state"]),
            memory_scope=MemoryScope(tuple(scope.get("layers", ())), tuple(scope.get("items", ()))),
            turn_intent=data["turn_intent"],
            zone_context=data["zone_context"],
            output_schema=data.get("output_schema", dict(TURN_SCHEMA)),
            player_utterance=data.get("player_utterance", ""),
            conversation=tuple((str(w), str(t)) for w, t in data.get("conversation", ())),
        )


def conversation_messages(conversation: tuple[tuple[str, str], ...]) -> list[dict[str, str]]:
    """The conversation so far as chat turns: the player's lines as ``user`` messages, the NPC's
    as ``assistant`` messages in the one reply form (:func:`render_reply`)."""
    return [
        {"role": "user", "content": text}
        if speaker == PLAYER
        else {"role": "assistant", "content": render_reply({"utterance": text})}
        for speaker, text in conversation
    ]


def conversation_tokens(speaker: str, text: str, count: Any) -> int:
    """What one conversation line costs in the prompt, by ``count`` (a ring's token count): its
    message as rendered plus the chat template's markers around a message."""
    content = text if speaker == PLAYER else render_reply({"utterance": text})
    return count(content) + MESSAGE_OVERHEAD


MESSAGE_OVERHEAD = 6  # chat-template tokens around one message (role markers, separators)


def _ordered(vector: dict[str, float]) -> list[tuple[str, float]]:
    return [(axis, vector[axis]) for axis in TRAIT_AXES if axis in vector]


def render_compact(prompt: TurnPrompt) -> list[dict[str, str]]:
    """Chat messages for a model carrying the register LoRA: the DSL as compact JSON.

    The default turn schema is left out (the LoRA has learnt it); any other schema is spelt out.
    """
    body = prompt.to_dict()
    body["trait_vector"] = dict(_ordered(prompt.trait_vector))
    if body["output_schema"] == TURN_SCHEMA:
        del body["output_schema"]
    utterance = body.pop("player_utterance")
    del body["conversation"]
    system = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
    return [
        {"role": "system", "content": system},
        *conversation_messages(prompt.conversation),
        {"role": "user", "content": utterance},
    ]


def parse_compact(messages: list[dict[str, str]]) -> TurnPrompt:
    """The TurnPrompt that :func:`render_compact` rendered into ``messages``."""
    data = json.loads(messages[0]["content"])
    data["player_utterance"] = messages[-1]["content"]
    data["conversation"] = [
        (PLAYER, m["content"]) if m["role"] == "user" else (NPC, json.loads(m["content"])["utterance"])
        for m in messages[1:-1]
    ]
    return TurnPrompt.from_dict(data)


def render_projection(prompt: TurnPrompt, register: Register | None = None) -> list[dict[str, str]]:
    """The trait-projection system message for a model without LoRAs (the design's fallback)."""
    lines = [f"You are speaking as {prompt.role}, a character with this Hellenic trait-profile:"]
    lines += [
        f"- {axis} {value:+.2f} ({describe(axis, value)})" for axis, value in _ordered(prompt.trait_vector)
    ]
    if register is not None:
        lines += [
            "",
            f"Your speech reflects this profile via register: {register.register}; "
            f"cadence: {register.cadence}; word choice: {', '.join(register.word_choice)}.",
        ]
    affect = prompt.affect_state
    lines += [
        "",
        f"Affect: {affect.mood} (valence {affect.valence:+.2f}, arousal {affect.arousal:.2f})",
        f"Current scene: {prompt.zone_context}",
        f"Memory scope: {', '.join(prompt.memory_scope.layers) or 'none'}",
    ]
    lines += [f"- {item}" for item in prompt.memory_scope.items]
    lines += [
        f"Turn intent: {prompt.turn_intent}",
        "",
        "Speak one turn, in character. Respond in JSON matching: "
        + json.dumps(prompt.output_schema, separators=(",", ":")),
    ]
    return [
        {"role": "system", "content": "\n".join(lines)},
        *conversation_messages(prompt.conversation),
        {"role": "user", "content": prompt.player_utterance},
    ]


def _in_schema_order(value: Any, schema: dict[str, Any]) -> Any:
    """``value`` with every object's keys in its schema's ``properties`` order (others after)."""
    if not isinstance(value, dict):
        return value
    props = schema.get("properties") or {}
    keys = [k for k in props if k in value] + [k for k in value if k not in props]
    return {k: _in_schema_order(value[k], props.get(k) or {}) for k in keys}


def render_reply_spans(
    reply: dict[str, Any], schema: dict[str, Any] = TURN_SCHEMA
) -> tuple[str, dict[str, tuple[int, int]]]:
    """:func:`render_reply`'s text and, for each top-level property, the [start, end) characters
    of its value in it (inside the quotes for a string)."""
    ordered = _in_schema_order(reply, schema)
    text, spans = "{", {}
    for i, (key, value) in enumerate(ordered.items()):
        text += (ITEM_SEPARATOR if i else "") + json.dumps(key, ensure_ascii=False) + KEY_SEPARATOR
        rendered = json.dumps(value, ensure_ascii=False, separators=(ITEM_SEPARATOR, KEY_SEPARATOR))
        quote = 1 if isinstance(value, str) else 0
        spans[key] = (len(text) + quote, len(text) + len(rendered) - quote)
        text += rendered
    return text + "}", spans


def render_reply(reply: dict[str, Any], schema: dict[str, Any] = TURN_SCHEMA) -> str:
    """The one text form of a turn's JSON reply: what training targets hold and the runtime
    grammar (:data:`REPLY_GRAMMAR_OPTIONS`, properties in schema order) lets a model write."""
    return render_reply_spans(reply, schema)[0]


_FENCE = re.compile(r"^\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def validate_reply(text: str | None, schema: dict[str, Any]) -> dict[str, Any]:
    """Parse a reply as JSON (a ```json fence is tolerated) and check it against ``schema``."""
    if text is None or not text.strip():
        raise ReplyError("empty", "the reply is empty")
    fenced = _FENCE.match(text)
    try:
        value = json.loads(fenced.group(1) if fenced else text)
    except json.JSONDecodeError as exc:
        raise ReplyError("not_json", f"{exc.msg} at character {exc.pos}") from exc
    errors = sorted(Draft202012Validator(schema).iter_errors(value), key=lambda e: list(e.path))
    if errors:
        where = "/".join(str(p) for p in errors[0].path) or "(root)"
        raise ReplyError("schema", f"{where}: {errors[0].message}")
    return value
