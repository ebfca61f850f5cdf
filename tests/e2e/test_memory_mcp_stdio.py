"""`nimmer memory mcp AGENT_DIR` as an MCP client meets it: a subprocess on stdio, driven by the
official SDK's stdio client, with the real embedding model and a workspace to ingest."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from tests.helpers import REPO
from tests.helpers.memory import MEMORY_TOOLS


@pytest.mark.slow
def test_the_cli_serves_the_memory_tools_over_stdio(tmp_path: Path) -> None:
    (tmp_path / "memory").mkdir()
    (tmp_path / "MEMORY.md").write_text("# Household\n\nThe spare key hangs behind the blue door.\n")
    params = StdioServerParameters(
        command=sys.executable,
        args=["-m", "nimmer_train.cli", "memory", "mcp", str(tmp_path), "--no-watch"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)},
        cwd=str(REPO),
    )

    async def session() -> None:
        with anyio.fail_after(300):  # hang guard only: the subprocess loads the model
            await drive()

    async def drive() -> None:
        async with Client(params) as client:
            names = [t.name for t in (await client.list_tools()).tools]
            assert names == [*MEMORY_TOOLS, "memory_record_exchange"]  # the server's way in (issue 40)
            found = await client.call_tool("memory_search", {"query": "where is the spare key"})
            top = found.structured_content["results"][0]
            assert top["path"] == "MEMORY.md" and "blue door" in top["text"]
            got = await client.call_tool(
                "memory_get", {"path": "MEMORY.md", "from": top["start_line"], "lines": 3}
            )
            assert "blue door" in got.structured_content["text"]
            bad = await client.call_tool("working_memory_note", {"note": "x", "importance": 7})
            assert bad.is_error and "argument 'importance'" in bad.content[0].text
            status = await client.call_tool("memory_status", {})
            assert status.structured_content["scheduler"]["max_instances"] == 1

    anyio.run(session)
