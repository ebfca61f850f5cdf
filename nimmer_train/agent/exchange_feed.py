"""What a standing agent hears: an exchange fed to it (the MCP server's ``memory_record_exchange``
tool) is queued for the transcript indexer, its detected events spike the agent's hormones (so
its mood moves and the dream gate sees sessions and rises), and its episode crystal carries the
exchange's emotional valence (from those events) and trait engagement (the caller's trait
profile of the voice that heard it). Without this a standing agent indexed no conversation and
its hormones stayed at rest.
"""

from __future__ import annotations

from typing import Any

from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.hormones import EVENTS, events_valence
from nimmer_train.agent.ingestion import Exchange, TranscriptIndexer
from nimmer_train.agent.subjects import USER_ROLES  # whose words imply events
from nimmer_train.agent.tool_registry import Tool, ToolArgumentError, object_schema
from nimmer_train.voice.traits import TRAIT_AXES


def record_exchange(
    agent: CrystalStore,
    indexer: TranscriptIndexer,
    messages: list[tuple[str, str]],
    session_id: str,
    turn_ids: tuple[str, ...] = (),
    events: tuple[str, ...] = (),
    traits: dict[str, float] | None = None,
) -> dict[str, Any]:
    """Queue one exchange for indexing and let its events move the hormones; returns what fired
    and the valence its memory carries."""
    unknown = [e for e in events if e not in EVENTS]
    if unknown:
        raise ToolArgumentError(f"events: {unknown} are not events ({', '.join(EVENTS)})")
    axes = [a for a in (traits or {}) if a not in TRAIT_AXES]
    if axes:
        raise ToolArgumentError(f"traits: {axes} are not trait axes ({', '.join(TRAIT_AXES)})")
    now = agent.clock()
    said = "\n".join(text for role, text in messages if role in USER_ROLES)
    with agent.lock:
        fired = agent.hormones.react(said, tuple(events), now)
    valence = events_valence(fired)
    indexer.submit(
        Exchange(session_id, turn_ids, tuple(messages), now, valence=valence, traits=dict(traits or {}))
    )
    return {"queued": True, "events": fired, "valence": round(valence, 6), "at": now}


def exchange_tool(agent: CrystalStore, indexer: TranscriptIndexer) -> Tool:
    """``memory_record_exchange``: the MCP server's way in for the conversation it serves."""
    schema = object_schema(
        {
            "messages": {
                "type": "array",
                "minItems": 1,
                "items": object_schema(
                    {
                        "role": {"type": "string", "minLength": 1},
                        "content": {"type": "string", "minLength": 1},
                    },
                    ("role", "content"),
                ),
            },
            "sessionId": {"type": "string", "minLength": 1},
            "turnId": {"type": "string", "minLength": 1},
            "events": {"type": "array", "items": {"type": "string", "enum": list(EVENTS)}},
            "traits": {
                "type": "object",
                "additionalProperties": {"type": "number", "minimum": -1, "maximum": 1},
            },
        },
        ("messages", "sessionId"),
    )
    return Tool(
        "memory_record_exchange",
        "Record one exchange of the conversation (its messages in order): it becomes an episode "
        "memory, and the events it implies move the agent's mood.",
        schema,
        lambda a: record_exchange(
            agent,
            indexer,
            [(m["role"], m["content"]) for m in a["messages"]],
            a["sessionId"],
            (a["turnId"],) if "turnId" in a else (),
            tuple(a.get("events", ())),
            a.get("traits"),
        ),
    )
