"""`nimmer memory mcp AGENT_DIR` fed a conversation over stdio (the official SDK's client): the
exchange it records is indexed (found by memory_search), its events move the hormones in
memory_status, and the scheduler's dream tick is reported (LLM modes skipped: no teacher)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import anyio
import pytest
from mcp import Client, StdioServerParameters

from tests.helpers import REPO


@pytest.mark.slow
def test_the_stdio_server_indexes_a_recorded_exchange_and_its_mood_moves(tmp_path: Path) -> None:
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
            rest = (await client.call_tool("memory_status", {})).structured_content["hormonalState"]
            said = "Thank you, my friend: the ferryman's daughter is called Oriel, we did it!"
            out = await client.call_tool(
                "memory_record_exchange",
                {
                    "messages": [
                        {"role": "user", "content": said},
                        {"role": "assistant", "content": "Oriel, noted."},
                    ],
                    "sessionId": "chat-1",
                    "turnId": "t1",
                },
            )
            assert not out.is_error and "reward" in out.structured_content["events"]
            found = []
            for _ in range(100):  # the indexer runs on its own thread: wait for the commit
                hits = await client.call_tool("memory_search", {"query": "ferryman's daughter name"})
                found = [h for h in hits.structured_content["results"] if h["session_id"] == "chat-1"]
                if found:
                    break
                await anyio.sleep(0.2)
            assert found and "Oriel" in found[0]["text"] and found[0]["turn_ids"] == ["t1"]
            status = (await client.call_tool("memory_status", {})).structured_content
            assert status["hormonalState"]["dopamine"] > rest["dopamine"]
            assert status["scheduler"]["dreams"]["llm_modes"] == "skipped: no teacher"
            bad = await client.call_tool(
                "memory_record_exchange",
                {"messages": [{"role": "user", "content": "x"}], "sessionId": "s", "events": ["nope"]},
            )
            assert bad.is_error and "events" in bad.content[0].text

    anyio.run(session)
