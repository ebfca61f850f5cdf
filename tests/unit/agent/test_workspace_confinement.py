"""An agent's memory files are read only from inside its folder: ``memory_get`` and ingestion
refuse a symlink anywhere on the path (the file, ``memory/``, a skills subfolder) and anything
that is not a ``.md`` memory file, so a link to a file outside is neither quoted to a client nor
indexed (and so never searchable, nor carried off by a Ring C turn). A directory path or a NUL
byte is a tool error naming ``path``, not an internal error.

``memory_get`` is driven over the MCP server that ``nimmer memory mcp`` runs (``build_server``
over the same tool registry), through the official SDK's in-process client: the stdio face
(tests/e2e/test_memory_mcp_stdio.py) differs only by its transport and loads the real embedding
model, which the hash embedder stands in for here."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import anyio
import pytest
from mcp import Client

from nimmer_train.agent.ingestion import ingest_workspace
from nimmer_train.agent.mcp_server import build_server
from nimmer_train.agent.recall import read_workspace_file
from nimmer_train.agent.tools import memory_tools
from nimmer_train.errors import NimmerError
from tests.helpers.memory import agent_memory

OUTSIDE = "-----BEGIN OPENSSH PRIVATE KEY----- the harbourmaster's vault opens with brass-owl-1743"


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A folder beside the agent's, holding what must never be read through it."""
    folder = tmp_path / "outside"
    folder.mkdir()
    for name in ("id_ed25519", "notes.md", "lore.md"):
        (folder / name).write_text(f"# Secrets\n\n{OUTSIDE}\n")
    return folder


def _links(agent_dir: Path, outside: Path) -> None:
    """Links out of the agent folder, each where a memory file or folder would be."""
    (agent_dir / "memory").mkdir(parents=True)
    (agent_dir / "memory" / "notes.md").symlink_to(outside / "id_ed25519")  # any extension
    (agent_dir / "skills").mkdir()
    (agent_dir / "skills" / "borrowed").symlink_to(outside, target_is_directory=True)
    (agent_dir / "MEMORY.md").symlink_to(outside / "notes.md")


def _memory_get(agent_dir: Path, arguments: list[dict]) -> list[tuple[bool, str]]:
    """(is_error, text) of each memory_get call, over the MCP server."""
    agent = agent_memory(agent_dir)
    server = build_server(memory_tools(agent))
    answers: list[tuple[bool, str]] = []

    async def session() -> None:
        with anyio.fail_after(60):
            async with Client(server) as client:
                for args in arguments:
                    got = await client.call_tool("memory_get", args)
                    answers.append((bool(got.is_error), " ".join(c.text for c in got.content)))

    try:
        anyio.run(session)
    finally:
        agent.close()
    return answers


def test_memory_get_refuses_links_out_of_the_agent_folder(tmp_path: Path, outside: Path) -> None:
    agent_dir = tmp_path / "agent"
    _links(agent_dir, outside)
    paths = ["memory/notes.md", "skills/borrowed/lore.md", "MEMORY.md"]
    answers = _memory_get(agent_dir, [{"path": p} for p in paths])
    for path, (is_error, text) in zip(paths, answers, strict=True):
        assert is_error and f"path: {path!r}" in text and "symbolic link" in text, (path, text)
        assert "brass-owl" not in text
    # a linked memory/ folder is refused the same way
    (agent_dir / "memory" / "notes.md").unlink()
    (agent_dir / "memory").rmdir()
    (agent_dir / "memory").symlink_to(outside, target_is_directory=True)
    [(is_error, text)] = _memory_get(agent_dir, [{"path": "memory/notes.md"}])
    assert is_error and "symbolic link" in text and "brass-owl" not in text, text


def test_memory_get_names_path_for_directories_nul_bytes_and_other_files(tmp_path: Path) -> None:
    agent_dir = tmp_path / "agent"
    (agent_dir / "memory" / "folder.md").mkdir(parents=True)
    (agent_dir / "memory" / "plain.txt").write_text("not a memory file\n")
    os.mkfifo(agent_dir / "memory" / "pipe.md")  # opening it for reading must not block the tool
    (agent_dir / "memory" / "real.md").write_text("the real note\n")
    cases = {
        "memory/folder.md": "not a regular file",
        "memory/pipe.md": "not a regular file",
        "memory/real\x00.md": "NUL",
        "memory/plain.txt": "not a memory file",
        "memory": "not a memory file",
    }
    answers = _memory_get(agent_dir, [{"path": p} for p in cases] + [{"path": "memory/real.md"}])
    for (path, words), (is_error, text) in zip(cases.items(), answers, strict=False):
        assert is_error and f"path: {path!r}" in text and words in text, (path, text)
    assert not answers[-1][0] and "the real note" in answers[-1][1]  # the server still answers


def test_ingestion_does_not_index_a_linked_file_outside_the_folder(
    tmp_path: Path, outside: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent_dir = tmp_path / "agent"
    _links(agent_dir, outside)
    (agent_dir / "memory" / "own.md").write_text("# Own\n\nThe ferry leaves at noon.\n")
    agent = agent_memory(agent_dir)
    try:
        with caplog.at_level(logging.WARNING, logger="nimmer_train.agent.ingestion"):
            total = ingest_workspace(agent)
        assert total["added"] == 1 and total["skipped"] >= 2, total  # own.md in; notes.md, MEMORY.md out
        texts = [h["text"] for h in agent.memory_search("harbourmaster vault brass owl", min_score=-1)]
        assert texts and not any("brass-owl" in t for t in texts), texts
        paths = {r[0] for r in agent.db("primary").execute("SELECT DISTINCT path FROM crystals")}
        assert paths == {"memory/own.md"}, paths
        messages = " ".join(r.getMessage() for r in caplog.records)
        assert "notes.md" in messages and "symbolic link" in messages
    finally:
        agent.close()


def test_memory_get_refuses_a_hard_linked_file(tmp_path: Path) -> None:
    """A hard link is no symlink, but it names a file outside the folder just the same."""
    outside = tmp_path / "outside.md"
    outside.write_text("SECRET outside\n")
    agent = tmp_path / "agent"
    (agent / "memory").mkdir(parents=True)
    os.link(outside, agent / "memory" / "hl.md")
    with pytest.raises(NimmerError, match="hard links"):
        read_workspace_file(agent, "memory/hl.md")
    (agent / "memory" / "own.md").write_text("mine\n")
    assert read_workspace_file(agent, "memory/own.md") == b"mine\n"
