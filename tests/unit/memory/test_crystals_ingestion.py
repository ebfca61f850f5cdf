"""Ingestion: Markdown chunks with line ranges, re-embedding only what changed, deleted and bad
files, edits during ingestion, the watchfiles watcher, skills, and background transcripts (also
fed by the runtime's turns)."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

import numpy as np

from nimmer_train.memory.crystals import CrystalSpec
from nimmer_train.memory.ingestion import (
    Exchange,
    TranscriptIndexer,
    WorkspaceWatcher,
    chunk_markdown,
    ingest_file,
    ingest_workspace,
)
from nimmer_train.memory.player_memory import Mode
from nimmer_train.memory.sync import open_player
from nimmer_train.runtime.rings import RingReply
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.prompt_dsl import render_compact
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.memory import Clock, CountingEmbedder, HashEmbedder, agent_memory

MEMORY_MD = """# People

Marta runs the bakery at the east gate.
She opens before dawn.

Ilse sells buttons.

# Places

The cisterns flood in spring.
"""


def _live(agent, path: str) -> list[tuple[str, int, int]]:  # noqa: ANN001
    with agent.lock:  # the store's connection is shared with the watcher's thread: one user at a time
        return _rows(agent, path)


def _rows(agent, path: str) -> list[tuple[str, int, int]]:  # noqa: ANN001
    return (
        agent.db("primary")
        .execute(
            "SELECT e.text, c.start_line, c.end_line FROM crystals c JOIN entries e ON e.id = c.entry_id "
            "WHERE c.path = ? AND c.lifecycle != 'expired' ORDER BY c.start_line",
            (path,),
        )
        .fetchall()
    )


def _wait(condition, what: str) -> None:  # noqa: ANN001
    deadline = time.monotonic() + 60  # hang guard only
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_chunks_follow_markdown_structure_with_line_ranges(tmp_path: Path) -> None:
    chunks = chunk_markdown(MEMORY_MD)
    assert [(c.start_line, c.end_line) for c in chunks] == [(1, 6), (8, 10)]
    small = chunk_markdown(MEMORY_MD, max_chars=50)
    assert [(c.start_line, c.end_line) for c in small] == [(1, 3), (4, 6), (8, 10)]
    long = chunk_markdown("\n".join(f"line {i} " + "x" * 60 for i in range(40)), max_chars=400)
    assert all(len(c.text) <= 400 for c in long) and long[-1].end_line == 40
    agent = agent_memory(tmp_path)
    (tmp_path / "MEMORY.md").write_text(MEMORY_MD)
    ingest_workspace(agent)
    for text, start, end in _live(agent, "MEMORY.md"):
        assert agent.memory_get("MEMORY.md", start, end - start + 1)["text"].strip() == text
    agent.close()


def test_an_edit_re_embeds_only_changed_chunks_and_a_deletion_expires(tmp_path: Path) -> None:
    embedder = CountingEmbedder()
    agent = agent_memory(tmp_path, embedder=embedder)
    (tmp_path / "memory").mkdir()
    doc = tmp_path / "memory" / "notes.md"
    doc.write_text("# A\n\nalpha facts\n\n# B\n\nbeta facts\n\n# C\n\ngamma facts\n")
    assert ingest_file(agent, "memory/notes.md")["added"] == 3
    embedder.texts.clear()
    doc.write_text("intro line\n\n# A\n\nalpha facts\n\n# B\n\nbeta facts, revised\n\n# C\n\ngamma facts\n")
    counts = ingest_file(agent, "memory/notes.md")
    assert counts == {"added": 2, "kept": 2, "expired": 1, "skipped": 0}
    assert embedder.texts == ["intro line", "# B\n\nbeta facts, revised"]
    assert [row[1:] for row in _live(agent, "memory/notes.md")] == [(1, 1), (3, 5), (7, 9), (11, 13)]
    doc.unlink()
    assert ingest_workspace(agent)["expired"] == 4
    assert _live(agent, "memory/notes.md") == []
    reasons = agent.db("primary").execute(
        "SELECT DISTINCT reason FROM crystal_audit WHERE to_state = 'expired'"
    )
    assert {r[0] for r in reasons} == {"source chunk changed or removed", "source file deleted"}
    agent.close()


def test_invalid_utf8_and_binary_files_are_skipped_with_a_warning(tmp_path: Path, caplog) -> None:
    agent = agent_memory(tmp_path)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "bad.md").write_bytes(b"caf\xe9 au lait\n")
    (tmp_path / "memory" / "blob.md").write_bytes(b"\x00\x01\x02binary")
    (tmp_path / "MEMORY.md").write_text("a good line\n")
    with caplog.at_level(logging.WARNING, logger="nimmer_train.memory.ingestion"):
        total = ingest_workspace(agent)
    assert total["skipped"] == 2 and total["added"] == 1
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "bad.md: not valid UTF-8 (byte 3)" in messages and "blob.md: binary file" in messages
    agent.close()


def test_a_file_edited_during_ingestion_converges_to_its_final_content(tmp_path: Path) -> None:
    (tmp_path / "MEMORY.md").write_text("# First\n\nthe first version\n")

    class EditingEmbedder(CountingEmbedder):
        def embed(self, texts):  # noqa: ANN001, ANN202 - the writer edits while we embed
            if not self.texts:
                (tmp_path / "MEMORY.md").write_text("# Final\n\nthe final version\n")
            return super().embed(texts)

    agent = agent_memory(tmp_path, embedder=EditingEmbedder())
    ingest_file(agent, "MEMORY.md")
    assert [row[0] for row in _live(agent, "MEMORY.md")] == ["# Final\n\nthe final version"]
    agent.close()


def test_skills_are_frozen_crystals(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    (tmp_path / "skills" / "brewing").mkdir(parents=True)
    (tmp_path / "skills" / "brewing" / "SKILL.md").write_text("# Brewing\n\nGrind, then pour slowly.\n")
    ingest_workspace(agent)
    rows = (
        agent.db("primary")
        .execute(
            "SELECT c.lifecycle, c.origin, c.lifespan, e.semantic_type FROM crystals c "
            "JOIN entries e ON e.id = c.entry_id"
        )
        .fetchall()
    )
    assert rows == [("frozen", "skill", "permanent", "skill")]
    agent.close()


def test_the_watcher_ingests_writes_edits_and_deletions(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    watcher = WorkspaceWatcher(agent, debounce_ms=100).start()
    try:
        (tmp_path / "memory").mkdir()
        time.sleep(0.3)
        (tmp_path / "memory" / "log.md").write_text("# Log\n\nthe lamp is lit\n")
        _wait(lambda: len(_live(agent, "memory/log.md")) == 1, "the new file's crystal")
        (tmp_path / "memory" / "log.md").write_text("# Log\n\nthe lamp is out\n")
        _wait(
            lambda: [r[0] for r in _live(agent, "memory/log.md")] == ["# Log\n\nthe lamp is out"], "the edit"
        )
        (tmp_path / "notes.txt").write_text("not a memory file")
        (tmp_path / "memory" / "log.md").unlink()
        _wait(lambda: _live(agent, "memory/log.md") == [], "the deletion")
        assert (
            agent.db("primary")
            .execute("SELECT count(*) FROM crystals WHERE path = 'notes.txt'")
            .fetchone()[0]
            == 0
        )
    finally:
        watcher.stop()
    assert not watcher.thread.is_alive()
    agent.close()


def test_transcripts_are_indexed_in_the_background(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    indexer = TranscriptIndexer(agent)
    for turn in range(50):
        indexer.submit(
            Exchange(
                "session-7",
                (f"t{2 * turn}", f"t{2 * turn + 1}"),
                (("player", f"question {turn} about the harbour"), ("npc:keeper", f"answer {turn}")),
                clock.now + turn,
            )
        )
    indexer.submit(
        Exchange("session-8", ("t0",), (("player", "said in the clasp"),), clock.now, Mode.IN_BETWEEN)
    )
    indexer.flush()
    assert len(indexer.lags_s) == 51 and indexer.backlog() == 0
    rows = (
        agent.db("primary")
        .execute(
            "SELECT e.session_id, c.turn_ids, e.speaker, e.semantic_type, c.origin, c.valid_from "
            "FROM crystals c JOIN entries e ON e.id = c.entry_id ORDER BY c.valid_from"
        )
        .fetchall()
    )
    assert len(rows) == 50
    assert rows[3] == ("session-7", '["t6", "t7"]', "player", "episode", "transcript", clock.now + 3)
    hit = agent.memory_search("question 17 about the harbour", min_score=-1, record_access=False)[0]
    assert hit["turn_ids"] == ["t34", "t35"] and hit["text"].startswith("player: question 17")
    clasp = agent.db("clasp").execute("SELECT text FROM entries").fetchall()
    assert clasp == [("player: said in the clasp",)]
    indexer.close()
    agent.add([CrystalSpec("after close", "note")])
    agent.close()


class _GatedEmbedder(HashEmbedder):
    """Embeds only once ``gate`` is set: shows a turn does not wait for its indexing."""

    def __init__(self) -> None:
        self.gate = threading.Event()

    def embed(self, texts: list[str]) -> np.ndarray:
        assert self.gate.wait(timeout=30)
        return super().embed(texts)


class _ScriptedRing:
    name, constrained, context_tokens = "test", False, None

    def __init__(self, lines: list[str]) -> None:
        self.texts = [json.dumps({"utterance": line}) for line in lines]

    @staticmethod
    def count(text: str) -> int:
        return len(text.split())

    def render(self, prompt, register):  # noqa: ANN001, ANN201
        return render_compact(prompt)

    def speak(self, prompt, register, name, knobs) -> RingReply:  # noqa: ANN001
        return RingReply(self.texts.pop(0), "test")


def test_runtime_turns_feed_the_transcript_indexer(tmp_path: Path) -> None:
    """A turn through NpcRuntime queues its exchange (player line + NPC reply) and returns; the
    indexer makes it a searchable episode crystal. An in-between exchange lands in the clasp
    store only, never in primary."""
    catalogue = load_catalogue()
    embedder = _GatedEmbedder()
    agent = agent_memory(tmp_path / "agent", embedder=embedder)
    indexer = TranscriptIndexer(agent)
    player, _ = open_player(tmp_path / "player", HashEmbedder())
    ring = _ScriptedRing(["The cistern under the tannery still holds water.", "I left the gate open."])
    runtime = NpcRuntime(catalogue, {"casual": ring}, memory=player, transcripts=indexer, session_id="s1")
    request = TurnRequest(
        npc="oran",
        gesture=catalogue.get("drunk-scavenger").traits,
        player_utterance="Where did the water go?",
        turn_intent="answer the player",
        zone_context="the scrap fields at dusk",
    )
    runtime.speak(request)
    runtime.speak(request, mode=Mode.IN_BETWEEN)
    primary = agent.db("primary")
    assert primary.execute("SELECT count(*) FROM entries").fetchone()[0] == 0  # not indexed yet: queued
    embedder.gate.set()
    indexer.flush()

    hit = agent.memory_search("cistern under the tannery", min_score=-1, record_access=False)[0]
    assert hit["text"] == (
        "player: Where did the water go?\nnpc:oran: The cistern under the tannery still holds water."
    )
    assert (hit["session_id"], hit["turn_ids"], hit["semantic_type"]) == ("s1:oran", ["oran-t1"], "episode")
    assert hit["store"] == "primary" and hit["data_category"] == "casual_dialog"  # consent's category
    texts = [t for (t,) in primary.execute("SELECT text FROM entries")]
    assert len(texts) == 1 and not any("gate open" in t for t in texts)
    clasp = agent.memory_search("left the gate open", min_score=-1, mode=Mode.IN_BETWEEN, record_access=False)
    assert clasp[0]["store"] == "clasp" and clasp[0]["turn_ids"] == ["oran-t2"]
    assert clasp[0]["data_category"] == "clasp"
    indexer.close()
    agent.close()
    player.close()
