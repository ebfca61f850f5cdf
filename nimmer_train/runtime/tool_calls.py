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
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from nimmer_train.agent.tool_registry import ToolArgumentError, ToolRegistry, UnknownTool
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


def run_tool_call(registry: ToolRegistry, name: str, arguments: str) -> ToolCallRecord:
    try:
        result = json.dumps(registry.call(name, arguments), ensure_ascii=False, default=str)
        return ToolCallRecord(name, arguments, True, result)
    except (ToolArgumentError, UnknownTool) as exc:
        return ToolCallRecord(name, arguments, False, json.dumps({"error": str(exc)}))


def chat_with_tools(
    teacher: OpenAICompatible, request: GenerationRequest, registry: ToolRegistry, max_rounds: int = 4
) -> ToolTurn:
    """One Ring C turn with the registry's tools (see the module docstring)."""
    if registry.mode is Mode.IN_BETWEEN:
        raise NimmerError(
            "Ring C is an external provider: it gets REALWORLD memory tools only (an IN_BETWEEN "
            "registry would send clasp crystals off the device)"
        )
    knobs = request.sampling
    body: dict[str, Any] = {
        "model": teacher.model,
        "temperature": knobs.temperature,
        "top_p": knobs.top_p,
        "max_tokens": teacher.cfg.max_new_tokens,
        "tools": registry.openai_schemas(),
    }
    dropped: tuple[str, ...] = EXTRA_KNOBS
    if teacher.cfg.extra_sampling:
        body.update({k: getattr(knobs, k) for k in EXTRA_KNOBS})
        dropped = ()
    if teacher.cfg.json_mode:
        body["response_format"] = {"type": "json_object"}
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

        request_body = {**body, "messages": messages, "tool_choice": "none" if last else "auto"}
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
            record = run_tool_call(registry, str(function.get("name")), function.get("arguments") or "{}")
            turn.calls.append(record)
            messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": record.result})
    return turn
