"""The memory tools: one registry, three faces (the Python API, the MCP server in mcp_server.py,
and OpenAI-style function schemas that Ring C passes to providers).

Each tool is a name, a description, a JSON schema for its arguments and a function of the
validated arguments. Arguments are checked against the schema before the function runs; a bad
one raises :class:`ToolArgumentError` naming the argument (MCP answers it as a tool error, Ring C
returns it to the model as the tool's result). Part 2 adds dream_search, dream_status,
curiosity_state and curiosity_resolve with :meth:`ToolRegistry.register`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

from nimmer_train.agent.agent_memory import NOTE_TYPES, AgentMemory
from nimmer_train.errors import NimmerError
from nimmer_train.memory.player_memory import Mode


class ToolArgumentError(NimmerError):
    """A tool call whose arguments do not fit the tool's schema; the message names the argument."""


class UnknownTool(NimmerError):
    pass


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]
    run: Callable[[dict[str, Any]], dict[str, Any]]


def _object(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(required),
        "additionalProperties": False,
    }


class ToolRegistry:
    """Tools by name; ``mode`` is the memory mode its tools act in (an IN_BETWEEN registry reads
    the clasp store, so only an on-device caller may hold it: Ring C refuses it)."""

    def __init__(self, mode: Mode = Mode.REALWORLD) -> None:
        self.tools: dict[str, Tool] = {}
        self.mode = mode

    def register(self, tool: Tool) -> None:
        if tool.name in self.tools:
            raise NimmerError(f"tool {tool.name!r} is registered already")
        jsonschema.Draft202012Validator.check_schema(tool.parameters)
        self.tools[tool.name] = tool

    def names(self) -> list[str]:
        return list(self.tools)

    def openai_schemas(self) -> list[dict[str, Any]]:
        """``tools`` for an OpenAI-compatible chat completions request."""
        return [
            {
                "type": "function",
                "function": {"name": t.name, "description": t.description, "parameters": t.parameters},
            }
            for t in self.tools.values()
        ]

    def call(self, name: str, arguments: dict[str, Any] | str | None = None) -> dict[str, Any]:
        """Validate and run one tool call (``arguments`` as a dict or a JSON text)."""
        tool = self.tools.get(name)
        if tool is None:
            raise UnknownTool(f"unknown tool {name!r}; known: {', '.join(self.tools)}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except json.JSONDecodeError as exc:
                raise ToolArgumentError(f"{name}: arguments are not valid JSON ({exc.msg})") from exc
        arguments = {} if arguments is None else arguments
        if not isinstance(arguments, dict):
            raise ToolArgumentError(f"{name}: arguments must be a JSON object")
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(tool.parameters).iter_errors(arguments)
        )
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path)
            raise ToolArgumentError(
                f"{name}: argument {where!r}: {error.message}" if where else f"{name}: {error.message}"
            )
        try:
            return tool.run(arguments)
        except ToolArgumentError:
            raise
        except NimmerError as exc:  # the library names the argument ("query: empty ...")
            raise ToolArgumentError(f"{name}: {exc}") from exc


def memory_tools(agent: AgentMemory, mode: Mode = Mode.REALWORLD, dreams: Any = True) -> ToolRegistry:
    """The registry of the memory tools over ``agent``, acting in ``mode``, with part 2's
    dream_search, dream_status, curiosity_state and curiosity_resolve over ``dreams`` (a
    :class:`nimmer_train.agent.dreams.DreamEngine`, True for the agent's default one, None for
    part 1's four tools only)."""
    registry = ToolRegistry(mode)
    registry.register(
        Tool(
            "memory_search",
            "Search the agent's memory (hybrid semantic + keyword). Use before answering about prior "
            "work, decisions, dates, people, preferences or todos.",
            _object(
                {
                    "query": {"type": "string", "minLength": 1},
                    "maxResults": {"type": "integer", "minimum": 1, "maximum": 50},
                    "minScore": {"type": "number", "minimum": -1, "maximum": 1},
                },
                ("query",),
            ),
            lambda a: {
                "results": agent.memory_search(
                    a["query"], a.get("maxResults", 6), a.get("minScore", 0.2), mode=mode
                )
            },
        )
    )
    registry.register(
        Tool(
            "memory_get",
            "Read exact lines of a memory file (MEMORY.md, memory/*.md, skills/...) after a search.",
            _object(
                {
                    "path": {"type": "string", "minLength": 1},
                    "from": {"type": "integer", "minimum": 1},
                    "lines": {"type": "integer", "minimum": 1},
                },
                ("path",),
            ),
            lambda a: agent.memory_get(a["path"], a.get("from", 1), a.get("lines")),
        )
    )
    registry.register(
        Tool(
            "memory_status",
            "Memory pipeline status: crystal lifecycle counts, consolidation times, scheduler, "
            "ingestion backlog, governance, goals and the user profile. action=sync re-ingests files.",
            _object({"action": {"type": "string", "enum": ["status", "sync"]}}),
            lambda a: _status(agent, mode, a.get("action", "status")),
        )
    )
    registry.register(
        Tool(
            "working_memory_note",
            "Persist something important now (searchable at once). type=directive records a user "
            "preference or correction and replaces the conflicting older one.",
            _object(
                {
                    "note": {"type": "string", "minLength": 1},
                    "importance": {"type": "number", "minimum": 0, "maximum": 1},
                    "type": {"type": "string", "enum": list(NOTE_TYPES)},
                },
                ("note",),
            ),
            lambda a: agent.working_memory_note(
                a["note"], a.get("importance", 0.7), a.get("type", "experience"), mode=mode
            ),
        )
    )
    if dreams is not None and dreams is not False:  # part 2: dreams and curiosity
        from nimmer_train.agent.dreams import register_tools

        register_tools(registry, agent, None if dreams is True else dreams)
    return registry


def _status(agent: AgentMemory, mode: Mode, action: str) -> dict[str, Any]:
    synced = None
    if action == "sync" and mode is Mode.REALWORLD:
        from nimmer_train.agent.ingestion import ingest_workspace

        synced = ingest_workspace(agent)
    return {**agent.memory_status(mode), "synced": synced}
