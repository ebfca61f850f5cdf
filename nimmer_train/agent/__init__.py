"""The agent runtime: an agent's long-term memory of knowledge crystals (issues 16-17) over the
player's stores in :mod:`nimmer_train.memory`: the crystal store and its writes, hybrid search,
importance and decay, ingestion of workspace files and transcripts, consolidation, hormones,
curiosity, dreams, and the memory tools (Python API, MCP server, provider tool schemas).
docs/memory.md lists the modules from the ground floor (tool_registry, crystals) to the top
(agent_memory, tools, mcp_server)."""
