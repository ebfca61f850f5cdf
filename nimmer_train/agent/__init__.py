"""The agent runtime: a self-evolving memory of knowledge crystals (the second design document)
over the player's stores in :mod:`nimmer_train.memory`: hybrid search, importance and decay,
ingestion of workspace files and transcripts, consolidation, hormones, dreams, curiosity, and the
memory tools (Python API, MCP server, provider tool schemas)."""
