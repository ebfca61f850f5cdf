"""The Ring C tool loop: the memory tools offered to an OpenAI-compatible provider as function
schemas, each tool call executed against the :class:`~nimmer_train.agent.tool_registry.ToolRegistry`
and answered in the same turn, until the model replies with text.

One request per round, through the teacher backend's client, URL, headers and retry policy.
A call with bad arguments (or an unknown tool) is answered to the model as
``{"error": "..."}`` naming the argument, so it can correct itself; it never ends the turn.
The last allowed round sends ``tool_choice: "none"`` so a model that keeps calling tools must
answer. An IN_BETWEEN registry is refused: the clasp has no path off the device. Anthropic
turns are served without tools (their tool channel carries the structured
turn, see backends.Anthropic).

The turn's mode gates the tools, not the registry's: an in-between turn (which the router may
send to Ring C, its clasp layer withheld) is offered only the tools that read
(agent.tools.READ_ONLY_TOOLS), and a call to any other tool is answered as an error without
running, so no in-between line reaches the primary store through a note, a search log or a
sync. The mode comes as ``mode``, or from :func:`turn_mode`, which NpcRuntime.speak sets around
generation (the Ring protocol's ``speak`` carries no mode). Outside any turn, with no mode given,
the loop fails closed: only the reading tools are offered, since nothing says the line is not an
in-between one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from nimmer_train.agent.tool_registry import ToolArgumentError, ToolRegistry, UnknownTool
from nimmer_train.agent.tools import READ_ONLY_TOOLS
from nimmer_train.errors import NimmerError
from nimmer_train.memory.player_memory import Mode
from nimmer_train.synth.teacher.backends import EXTRA_KNOBS, OpenAICompatible
from nimmer_train.synth.teacher.base import TeacherReply
from nimmer_train.synth.teacher.http import post_with_retries
from nimmer_train.voice.composition import GenerationRequest


@dataclass
class ToolCallRecord:
    name: str
    arguments: str
    ok: bool
    result: str


@dataclass
class ToolTurn:
    reply: TeacherReply
    calls: list[ToolCallRecord] = field(default_factory=list)
    rounds: int = 0


_TURN_MODE: ContextVar[Mode | None] = ContextVar("nimmer_turn_mode", default=None)


@contextmanager
def turn_mode(mode: Mode) -> Iterator[None]:
    """Within this block, Ring C's tool loop serves a turn in ``mode`` (outside any turn: the
    reading tools only, as for an in-between turn)."""
    token = _TURN_MODE.set(mode)
    try:
        yield
    finally:
        _TURN_MODE.reset(token)


def offered_tools(registry: ToolRegistry, mode: Mode | None) -> list[str]:
    """The tools a turn in ``mode`` may offer a remote ring: all of them in the realworld, the
    read-only ones in the in-between or when the mode is unknown (None)."""
    return [n for n in registry.names() if mode is Mode.REALWORLD or n in READ_ONLY_TOOLS]


def run_tool_call(
    registry: ToolRegistry, name: str, arguments: str, offered: list[str] | None = None
) -> ToolCallRecord:
    """Run one call the provider sent; a tool outside ``offered`` (None: all) is refused unrun."""
    if offered is not None and name in registry.tools and name not in offered:
        error = f"{name} is not offered on an in-between turn: nothing said there is written to memory"
        return ToolCallRecord(name, arguments, False, json.dumps({"error": error}))
    try:
        result = json.dumps(registry.call(name, arguments), ensure_ascii=False, default=str)
        return ToolCallRecord(name, arguments, True, result)
    except (ToolArgumentError, UnknownTool) as exc:
        return ToolCallRecord(name, arguments, False, json.dumps({"error": str(exc)}))


def _request_body(
    teacher: OpenAICompatible, request: GenerationRequest, schemas: list[dict[str, Any]]
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The request fields every round shares, and the knobs the provider does not get."""
    knobs = request.sampling
    body: dict[str, Any] = {
        "model": teacher.model,
        "temperature": knobs.temperature,
        "top_p": knobs.top_p,
        "max_tokens": teacher.cfg.max_new_tokens,
    }
    if schemas:  # an empty tools list is refused by OpenAI-compatible servers
        body["tools"] = schemas
    dropped: tuple[str, ...] = EXTRA_KNOBS
    if teacher.cfg.extra_sampling:
        body.update({k: getattr(knobs, k) for k in EXTRA_KNOBS})
        dropped = ()
    if teacher.cfg.json_mode:
        body["response_format"] = {"type": "json_object"}
    return body, dropped


def chat_with_tools(
    teacher: OpenAICompatible,
    request: GenerationRequest,
    registry: ToolRegistry,
    max_rounds: int = 4,
    mode: Mode | None = None,
) -> ToolTurn:
    """One Ring C turn with the registry's tools that the turn's ``mode`` allows (None: the mode
    :func:`turn_mode` set; see the module docstring)."""
    if registry.mode is Mode.IN_BETWEEN:
        raise NimmerError(
            "Ring C is an external provider: it gets REALWORLD memory tools only (an IN_BETWEEN "
            "registry would send clasp crystals off the device)"
        )
    offered = offered_tools(registry, _TURN_MODE.get() if mode is None else mode)
    schemas = [s for s in registry.openai_schemas() if s["function"]["name"] in offered]
    body, dropped = _request_body(teacher, request, schemas)
    messages: list[dict[str, Any]] = list(request.messages)
    turn = ToolTurn(TeacherReply("", 0, 0))
    prompt_tokens = completion_tokens = 0
    started = time.perf_counter()
    for round_no in range(1, max_rounds + 1):
        last = round_no == max_rounds
        raw: dict[str, Any] = {}

        def parse(data: dict[str, Any], raw: dict[str, Any] = raw) -> TeacherReply:
            raw.update(data)
            usage = data.get("usage") or {}
            message = data["choices"][0]["message"]
            return TeacherReply(
                message.get("content") or "",
                int(usage.get("prompt_tokens", 0)),
                int(usage.get("completion_tokens", 0)),
                dropped_knobs=dropped,
            )

        request_body = {**body, "messages": messages}
        if schemas:
            request_body["tool_choice"] = "none" if last else "auto"
        reply = post_with_retries(
            teacher.client, teacher.url, request_body, teacher.headers, teacher.cfg, parse
        )
        turn.rounds = round_no
        prompt_tokens += reply.prompt_tokens
        completion_tokens += reply.completion_tokens
        calls = [] if reply.error else (raw["choices"][0]["message"].get("tool_calls") or [])
        if not calls or last:
            turn.reply = TeacherReply(
                reply.content,
                prompt_tokens,
                completion_tokens,
                latency_s=time.perf_counter() - started,
                dropped_knobs=dropped,
                error=reply.error or (None if reply.content else "tool_rounds_exhausted" if calls else None),
            )
            return turn
        messages.append({"role": "assistant", "content": reply.content or None, "tool_calls": calls})
        for call in calls:
            function = call.get("function") or {}
            arguments = function.get("arguments") or "{}"
            record = run_tool_call(registry, str(function.get("name")), arguments, offered)
            turn.calls.append(record)
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": record.result})
    return turn
