"""The memory tool registry: the Python face, the MCP server (the official SDK's in-process
client) and the OpenAI-style schemas; bad arguments are tool errors that name the argument."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from mcp import Client

from nimmer_train.agent.mcp_server import build_server
from nimmer_train.agent.tool_registry import Tool, ToolArgumentError, UnknownTool
from nimmer_train.agent.tools import memory_tools
from nimmer_train.errors import NimmerError
from nimmer_train.memory.player_memory import Mode
from tests.helpers.memory import agent_memory

SEED_TOOLS = ["memory_search", "memory_get", "memory_status", "working_memory_note"]
DREAM_TOOLS = ["dream_search", "dream_status", "curiosity_state", "curiosity_resolve"]
ALL_TOOLS = SEED_TOOLS + DREAM_TOOLS


def test_registry_schemas_and_argument_errors(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    assert memory_tools(agent, dreams=None).names() == SEED_TOOLS
    registry = memory_tools(agent)
    assert registry.names() == ALL_TOOLS
    schemas = {s["function"]["name"]: s for s in registry.openai_schemas()}
    assert schemas["memory_search"]["type"] == "function"
    assert schemas["memory_search"]["function"]["parameters"]["required"] == ["query"]
    assert set(schemas["working_memory_note"]["function"]["parameters"]["properties"]["type"]["enum"]) == {
        "experience",
        "directive",
        "world_fact",
        "mental_model",
    }
    for arguments, named in (
        ({"query": 3}, "argument 'query'"),
        ({}, "'query' is a required property"),
        ({"query": "x", "maxResults": 0}, "argument 'maxResults'"),
        ({"query": "x", "limit": 3}, "'limit' was unexpected"),
        ('{"query": ', "not valid JSON"),
        ({"query": "   "}, "query: empty"),
    ):
        with pytest.raises(ToolArgumentError, match=named):
            registry.call("memory_search", arguments)
    with pytest.raises(ToolArgumentError, match="argument 'type'"):
        registry.call("working_memory_note", {"note": "x", "type": "gossip"})
    with pytest.raises(ToolArgumentError, match="path"):
        registry.call("memory_get", {"path": "/etc/passwd"})
    with pytest.raises(UnknownTool, match="dream_weave"):
        registry.call("dream_weave", {"query": "x"})
    registry.register(
        Tool("dream_weave", "a later tool plugs in here", {"type": "object", "properties": {}}, lambda a: {})
    )
    assert registry.names()[-1] == "dream_weave" and registry.call("dream_weave") == {}
    with pytest.raises(NimmerError, match="registered already"):
        registry.register(Tool("dream_status", "twice", {"type": "object", "properties": {}}, lambda a: {}))
    agent.close()


def test_python_face_round_trip(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    registry = memory_tools(agent)
    note = registry.call(
        "working_memory_note", {"note": "The lamp oil is kept in the cellar", "type": "world_fact"}
    )
    found = registry.call("memory_search", {"query": "lamp oil cellar", "maxResults": 1})["results"]
    assert found[0]["id"] == note["id"] and found[0]["semantic_type"] == "fact"
    got = registry.call("memory_get", {"path": "memory/scratch.md", "from": 1, "lines": 1})
    assert got["text"].endswith("The lamp oil is kept in the cellar")
    status = registry.call("memory_status", {"action": "sync"})
    assert status["stores"]["primary"]["lifecycle"]["activated"] == 1 and status["synced"]["kept"] == 1
    in_between = memory_tools(agent, Mode.IN_BETWEEN)
    assert in_between.call("working_memory_note", {"note": "clasp words"})["stored"] == "clasp"
    agent.close()


def test_mcp_server_answers_tools_and_reports_bad_arguments(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    server = build_server(memory_tools(agent))

    async def session() -> None:
        async with Client(server) as client:
            listed = await client.list_tools()
            assert [t.name for t in listed.tools] == ALL_TOOLS
            schema = {t.name: t.input_schema for t in listed.tools}["memory_get"]
            assert schema["required"] == ["path"] and "from" in schema["properties"]
            noted = await client.call_tool("working_memory_note", {"note": "The ferry leaves at noon"})
            assert not noted.is_error and noted.structured_content["stored"] == "primary"
            found = await client.call_tool("memory_search", {"query": "when does the ferry leave"})
            assert found.structured_content["results"][0]["text"] == "The ferry leaves at noon"
            bad = await client.call_tool("memory_search", {"query": "ferry", "maxResults": "many"})
            assert bad.is_error and "argument 'maxResults'" in bad.content[0].text
            missing = await client.call_tool("memory_get", {})
            assert missing.is_error and "'path' is a required property" in missing.content[0].text
            unknown = await client.call_tool("curiosity_weave", {})
            assert unknown.is_error and "unknown tool 'curiosity_weave'" in unknown.content[0].text
            status = await client.call_tool("memory_status", {})  # the server is still up
            assert status.structured_content["stores"]["primary"]["lifecycle"]["activated"] == 1

    anyio.run(session)
    agent.close()
