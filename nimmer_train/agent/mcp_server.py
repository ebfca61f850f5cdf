"""The memory tools as an MCP server (the official ``mcp`` SDK, low-level Server, stdio).

A standing server runs the memory on its own: it ingests and watches the workspace, indexes the
exchanges its client records (``memory_record_exchange``, exchange_feed.py: their events move
the hormones), and its scheduler consolidates on schedule and ticks the dream engine (the LLM
modes with the teacher it is given, else reported skipped).

The tool list and argument schemas come from the same :class:`ToolRegistry` that Ring C uses,
so the three faces cannot drift. A call with bad arguments is answered as a tool error
(``is_error``) whose text names the argument; the server keeps running. Tool functions run on a
worker thread (SQLite and the embedder are blocking).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.dreams import DreamEngine
from nimmer_train.agent.exchange_feed import exchange_tool
from nimmer_train.agent.extra import missing_extra
from nimmer_train.agent.ingestion import TranscriptIndexer, WorkspaceWatcher, ingest_workspace
from nimmer_train.agent.scheduler import ConsolidationScheduler
from nimmer_train.agent.tool_registry import ToolArgumentError, ToolRegistry, UnknownTool
from nimmer_train.agent.tools import memory_tools
from nimmer_train.memory.embedding import SentenceEmbedder

try:  # the agent extra (extra.py): nothing but this server speaks MCP
    import mcp_types as types
    from mcp.server.lowlevel.server import Server
    from mcp.server.stdio import stdio_server
except ImportError as exc:
    raise missing_extra("mcp", "the MCP server (nimmer memory mcp)") from exc


def build_server(registry: ToolRegistry, name: str = "nimmer-memory") -> Server[Any]:
    async def list_tools(_ctx: Any, _params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(
            tools=[
                types.Tool(name=t.name, description=t.description, input_schema=t.parameters)
                for t in registry.tools.values()
            ]
        )

    async def call_tool(_ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
        try:
            result = await anyio.to_thread.run_sync(registry.call, params.name, params.arguments or {})
        except (ToolArgumentError, UnknownTool) as exc:
            return types.CallToolResult(
                content=[types.TextContent(type="text", text=str(exc))], is_error=True
            )
        text = json.dumps(result, ensure_ascii=False, default=str)
        return types.CallToolResult(
            content=[types.TextContent(type="text", text=text)], structured_content=json.loads(text)
        )

    return Server(name, on_list_tools=list_tools, on_call_tool=call_tool)


def serve_stdio(folder: Path, embedder: Any = None, watch: bool = True, teacher: Any = None) -> None:
    """``nimmer memory mcp AGENT_DIR``: ingest the workspace, watch it, index recorded exchanges,
    consolidate and dream on schedule (``teacher``: a teacher backend for the LLM dream modes),
    and answer the memory tools on stdin/stdout until the client closes."""
    agent = AgentMemory(folder, embedder or SentenceEmbedder())
    ingest_workspace(agent)
    watcher = WorkspaceWatcher(agent).start() if watch else None
    indexer = TranscriptIndexer(agent)
    agent.ingestion_backlog = lambda: {
        "files_pending": len(watcher.pending) if watcher is not None else 0,
        "exchanges_pending": indexer.backlog(),
    }
    dreams = DreamEngine(agent, teacher=teacher)
    scheduler = ConsolidationScheduler(agent, dreams=dreams).start()
    registry = memory_tools(agent, dreams=dreams)  # the dream tools read the scheduled engine
    registry.register(exchange_tool(agent, indexer))
    server = build_server(registry)

    async def main() -> None:
        async with stdio_server() as (read, write):
            await server.run(read, write, server.create_initialization_options())

    try:
        anyio.run(main)
    finally:
        scheduler.shutdown()
        indexer.close()
        if watcher is not None:
            watcher.stop()
        agent.close()
