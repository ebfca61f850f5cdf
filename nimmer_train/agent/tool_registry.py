"""The tool registry: one registry, three faces (the Python API, the MCP server in
mcp_server.py, and OpenAI-style function schemas that Ring C passes to providers).

Each tool is a name, a description, a JSON schema for its arguments and a function of the
validated arguments. Arguments are checked against the schema before the function runs; a bad
one raises :class:`ToolArgumentError` naming the argument (MCP answers it as a tool error, Ring C
returns it to the model as the tool's result). The registry knows nothing of memory, so every
module of the agent may build on it; tools.py fills it with the memory tools.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jsonschema

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


def object_schema(properties: dict[str, Any], required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The JSON schema of a tool's arguments: an object of ``properties``, nothing else allowed."""
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
