"""The memory tools: the registry of tool_registry.py filled over one agent. Part 1's four
(memory_search, memory_get, memory_status, working_memory_note) and part 2's four over the
dream engine and curiosity (dream_search, dream_status, curiosity_state, curiosity_resolve).
The MCP server and Ring C both take the registry :func:`memory_tools` builds."""

from __future__ import annotations

from typing import Any

from nimmer_train.agent import curiosity
from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.dreams import DreamEngine
from nimmer_train.agent.ingestion import ingest_workspace
from nimmer_train.agent.scratch import NOTE_TYPES
from nimmer_train.agent.tool_registry import Tool, ToolRegistry, object_schema
from nimmer_train.memory.player_memory import Mode

# The tools that only read (no note, no search log or access count, no sync, no resolve): the
# only ones an in-between turn may offer a remote ring (runtime/tool_calls.py), since whatever a
# writing tool stores there would carry in-between speech into the primary store. A new tool is
# kept off in-between turns until it is listed here.
READ_ONLY_TOOLS = frozenset({"memory_get", "dream_search", "dream_status", "curiosity_state"})


def memory_tools(agent: AgentMemory, mode: Mode = Mode.REALWORLD, dreams: Any = True) -> ToolRegistry:
    """The registry of the memory tools over ``agent``, acting in ``mode``, with part 2's
    dream_search, dream_status, curiosity_state and curiosity_resolve over ``dreams`` (a
    :class:`~nimmer_train.agent.dreams.DreamEngine`, True for the agent's default one, None for
    part 1's four tools only)."""
    registry = ToolRegistry(mode)
    for tool in _memory_tools(agent, mode):
        registry.register(tool)
    if dreams is not None and dreams is not False:  # part 2: dreams and curiosity
        for tool in _dream_tools(agent, None if dreams is True else dreams):
            registry.register(tool)
    return registry


def _search_schema() -> dict[str, Any]:
    """memory_search's and dream_search's arguments (a fresh schema for each tool)."""
    return object_schema(
        {
            "query": {"type": "string", "minLength": 1},
            "maxResults": {"type": "integer", "minimum": 1, "maximum": 50},
            "minScore": {"type": "number", "minimum": -1, "maximum": 1},
        },
        ("query",),
    )


def _memory_tools(agent: AgentMemory, mode: Mode) -> list[Tool]:
    return [
        Tool(
            "memory_search",
            "Search the agent's memory (hybrid semantic + keyword). Use before answering about prior "
            "work, decisions, dates, people, preferences or todos.",
            _search_schema(),
            lambda a: {
                "results": agent.memory_search(
                    a["query"], a.get("maxResults", 6), a.get("minScore", 0.2), mode=mode
                )
            },
        ),
        Tool(
            "memory_get",
            "Read exact lines of a memory file (MEMORY.md, memory/*.md, skills/...) after a search.",
            object_schema(
                {
                    "path": {"type": "string", "minLength": 1},
                    "from": {"type": "integer", "minimum": 1},
                    "lines": {"type": "integer", "minimum": 1},
                },
                ("path",),
            ),
            lambda a: agent.memory_get(a["path"], a.get("from", 1), a.get("lines")),
        ),
        Tool(
            "memory_status",
            "Memory pipeline status: crystal lifecycle counts, consolidation times, scheduler, "
            "ingestion backlog, governance, goals and the user profile. action=sync re-ingests files.",
            object_schema({"action": {"type": "string", "enum": ["status", "sync"]}}),
            lambda a: _status(agent, mode, a.get("action", "status")),
        ),
        Tool(
            "working_memory_note",
            "Persist something important now (searchable at once). type=directive records a user "
            "preference or correction and replaces the conflicting older one.",
            object_schema(
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
        ),
    ]


def _status(agent: AgentMemory, mode: Mode, action: str) -> dict[str, Any]:
    synced = None
    if action == "sync" and mode is Mode.REALWORLD:
        synced = ingest_workspace(agent)
    return {**agent.memory_status(mode), "synced": synced}


def _dream_tools(agent: AgentMemory, engine: DreamEngine | None) -> list[Tool]:
    """dream_search, dream_status, curiosity_state and curiosity_resolve."""
    engine = engine or getattr(agent, "dreams", None) or DreamEngine(agent)
    return [
        Tool(
            "dream_search",
            "Search the insights the agent's dreams produced (insight crystals only).",
            _search_schema(),
            lambda a: {"results": engine.search(a["query"], a.get("maxResults", 6), a.get("minScore", 0.0))},
        ),
        Tool(
            "dream_status",
            "Dream engine status: gate state, last cycle, insight counts and the LLM call budget.",
            object_schema({}),
            lambda a: engine.status(),
        ),
        Tool(
            "curiosity_state",
            "Knowledge regions and open curiosity targets (gaps, stale regions, contradictions, frontiers).",
            object_schema({}),
            lambda a: curiosity.curiosity_state(agent),
        ),
        Tool(
            "curiosity_resolve",
            "Mark a curiosity target resolved once its question is answered.",
            object_schema({"targetId": {"type": "string", "minLength": 1}}, ("targetId",)),
            lambda a: curiosity.curiosity_resolve(agent, a["targetId"]),
        ),
    ]
