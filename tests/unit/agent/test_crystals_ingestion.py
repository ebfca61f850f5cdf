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

from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.ingestion import (
    Exchange,
    IndexerClosed,
    TranscriptIndexer,
    WorkspaceWatcher,
    chunk_markdown,
    exchange_specs,
    index_exchanges,
    ingest_file,
    ingest_workspace,
)
from nimmer_train.errors import NimmerError
from nimmer_train.memory.consent import exclude, grant, training_examples, write_profile
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
    with caplog.at_level(logging.WARNING, logger="nimmer_train.agent.ingestion"):
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
    # two speakers: the episode's speaker says it is an exchange, not the player's words
    assert rows[3] == ("session-7", '["t6", "t7"]', "exchange", "episode", "transcript", clock.now + 3)
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
    assert clasp[0]["store"] == "clasp" and clasp[0]["turn_ids"] == ["oran-clasp-t1"]  # numbered per store
    assert clasp[0]["data_category"] == "clasp"
    indexer.close()
    agent.close()
    player.close()


# -- the runtime -> indexer path under faults (review of issue 16) ------------------------------
class _FailingEmbedder(HashEmbedder):
    """Raises on its first ``failures`` calls (a transient fault: a busy store, a model hiccup)."""

    def __init__(self, failures: int) -> None:
        self.calls, self.failures = 0, failures

    def embed(self, texts: list[str]) -> np.ndarray:
        self.calls += 1
        if self.calls <= self.failures:
            raise RuntimeError("transient embedder fault")
        return super().embed(texts)


def _request(catalogue, said: str = "Where did the water go?") -> TurnRequest:  # noqa: ANN001
    return TurnRequest(
        npc="oran",
        gesture=catalogue.get("drunk-scavenger").traits,
        player_utterance=said,
        turn_intent="answer the player",
        zone_context="the scrap fields at dusk",
    )


def _texts(agent, store: str = "primary") -> list[str]:  # noqa: ANN001
    with agent.lock:
        return [t for (t,) in agent.db(store).execute("SELECT text FROM entries ORDER BY id")]


def _turn_ids(agent, store: str = "primary") -> list[list[str]]:  # noqa: ANN001
    with agent.lock:
        rows = agent.db(store).execute("SELECT turn_ids FROM crystals ORDER BY entry_id").fetchall()
    return [json.loads(r[0]) for r in rows]


def test_an_oversized_exchange_is_split_and_does_not_lose_its_batch(tmp_path: Path) -> None:
    """Each line alone fits an entry, the joined exchange does not: it is stored as parts that
    say so (every line still naming its speaker), and the exchanges dequeued with it are indexed."""
    catalogue = load_catalogue()
    embedder = _GatedEmbedder()
    agent = agent_memory(tmp_path / "agent", embedder=embedder)
    indexer = TranscriptIndexer(agent)
    player, _ = open_player(tmp_path / "player", HashEmbedder())
    long_reply = "The water went down the old drain. " * 60  # ~2100 chars: the write-back takes it
    ring = _ScriptedRing(["first reply", "second reply", long_reply, "fourth reply"])
    runtime = NpcRuntime(catalogue, {"casual": ring}, memory=player, transcripts=indexer, session_id="s")
    runtime.speak(_request(catalogue))
    _wait(lambda: indexer.backlog() == 0, "the indexer to take turn 1 (it blocks in embed)")
    runtime.speak(_request(catalogue, "And the second thing?"))
    long_said = "Tell me everything, slowly. " * 80  # ~2240 chars
    runtime.speak(_request(catalogue, long_said))
    runtime.speak(_request(catalogue, "And the fourth?"))  # turns 2-4 wait in one batch
    embedder.gate.set()
    assert indexer.flush(timeout=30)
    with agent.lock:
        rows = (
            agent.db("primary")
            .execute(
                "SELECT e.text, e.speaker, c.turn_ids FROM entries e JOIN crystals c ON c.entry_id = e.id "
                "ORDER BY e.id"
            )
            .fetchall()
        )
    try:
        assert any("second reply" in t for t, _, _ in rows) and any("fourth reply" in t for t, _, _ in rows)
        parts = [(t, s) for t, s, ids in rows if json.loads(ids) == ["oran-t3"]]
        assert len(parts) == 2 and all(len(t) <= agent.memory.max_chars for t, _ in parts)
        assert parts[0][0].startswith("[exchange part 1 of 2, split to fit the entry limit]\nplayer: Tell")
        assert parts[1][0].startswith("[exchange part 2 of 2, split to fit the entry limit]\n")
        assert all(s == "exchange" for _, s in parts)
        body = " ".join(t.split("\n", 1)[1] for t, _ in parts)
        assert body.count("Tell me everything") == 80 and body.count("old drain") == 60  # nothing lost
        assert "npc:oran: The water" in body and not indexer.dropped
    finally:
        indexer.close()
        agent.close()
        player.close()


def test_a_bad_exchange_is_dropped_alone_with_its_reason(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """A batch that fails is indexed one exchange at a time: only the bad one is lost, logged
    with why, and a refused content is not retried. A lone surrogate is repaired, not refused."""
    embedder = _GatedEmbedder()
    agent = agent_memory(tmp_path, embedder=embedder)
    indexer = TranscriptIndexer(agent, backoff_s=0.01)
    indexer.submit(Exchange("s", ("t0",), (("player", "warm-up"),), 1.0))
    _wait(lambda: indexer.backlog() == 0, "the indexer to take the warm-up (it blocks in embed)")
    indexer.submit(Exchange("s", ("t1",), (("player", "before the bad one"),), 2.0))
    indexer.submit(Exchange("s", ("t2",), (("player", "wrong category"),), 3.0, data_category="no-such"))
    indexer.submit(Exchange("s", ("t3",), (("player", "half a pair \ud83d here"),), 4.0))
    indexer.submit(Exchange("s", ("t4",), (("player", "after the bad one"),), 5.0))
    with caplog.at_level(logging.WARNING, logger="nimmer_train.agent.ingestion"):
        embedder.gate.set()
        assert indexer.flush(timeout=30)
    texts = _texts(agent)
    try:
        assert texts == [
            "player: warm-up",
            "player: before the bad one",
            "player: half a pair \ufffd here",
            "player: after the bad one",
        ]
        assert [label for label, _ in indexer.dropped] == ["s t2"]
        assert "data_category" in indexer.dropped[0][1] and "no-such" in indexer.dropped[0][1]
        assert "one at a time" in caplog.text
        assert "s t2 not indexed (refused by the store)" in caplog.text
    finally:
        indexer.close()
        agent.close()


def test_a_transient_failure_is_retried_and_a_lasting_one_dropped_after_three_tries(
    tmp_path: Path,
    caplog,  # noqa: ANN001
) -> None:
    catalogue = load_catalogue()
    agent = agent_memory(tmp_path / "once", embedder=_FailingEmbedder(1))
    indexer = TranscriptIndexer(agent, backoff_s=0.01)
    runtime = NpcRuntime(
        catalogue, {"casual": _ScriptedRing(["The cistern holds water."])}, transcripts=indexer
    )
    runtime.speak(_request(catalogue))
    assert indexer.flush(timeout=30)
    assert any("cistern holds water" in t for t in _texts(agent)) and not indexer.dropped
    indexer.close()
    agent.close()

    embedder = _FailingEmbedder(10**6)
    agent = agent_memory(tmp_path / "always", embedder=embedder)
    indexer = TranscriptIndexer(agent, backoff_s=0.01)
    with caplog.at_level(logging.ERROR, logger="nimmer_train.agent.ingestion"):
        indexer.submit(Exchange("s", ("t1",), (("player", "lost"),), 1.0))
        assert indexer.flush(timeout=30)
    try:
        assert embedder.calls == 3 and [label for label, _ in indexer.dropped] == ["s t1"]
        assert "s t1 not indexed (after 3 tries): RuntimeError: transient embedder fault" in caplog.text
        assert _texts(agent) == []
    finally:
        indexer.close()
        agent.close()


def test_a_closed_indexer_refuses_and_the_turn_still_succeeds(tmp_path: Path, caplog) -> None:  # noqa: ANN001
    """submit after close raises; the runtime logs it and the turn carries a warning (memory
    indexing never fails a turn); flush returns; a second close does nothing."""
    catalogue = load_catalogue()
    agent = agent_memory(tmp_path / "agent")
    indexer = TranscriptIndexer(agent)
    indexer.submit(Exchange("s", ("t1",), (("player", "queued before close"),), 1.0))
    indexer.close()  # what was queued before close is indexed
    assert _texts(agent) == ["player: queued before close"]
    try:
        indexer.submit(Exchange("s", ("t2",), (("player", "late"),), 2.0))
        raise AssertionError("submit after close was accepted")
    except IndexerClosed as exc:
        assert "is closed" in str(exc) and "s t2" in str(exc)
    runtime = NpcRuntime(catalogue, {"casual": _ScriptedRing(["After close."])}, transcripts=indexer)
    with caplog.at_level(logging.WARNING, logger="nimmer_train.runtime.turn"):
        turn = runtime.speak(_request(catalogue))
    assert turn.reply["utterance"] == "After close."
    assert "transcript_not_indexed" in turn.feature_compat_warnings
    assert "exchange not indexed" in caplog.text
    done = threading.Event()
    threading.Thread(target=lambda: (indexer.flush(), done.set()), daemon=True).start()
    assert done.wait(timeout=5), "flush() after close() hangs"
    indexer.close()
    assert _texts(agent) == ["player: queued before close"]
    agent.close()


def test_a_mode_given_by_value_means_the_same_as_the_enum(tmp_path: Path) -> None:
    """speak(mode="in_between") is the in-between: the NPC line goes to the player's clasp
    store, the exchange to the agent's clasp store, nothing to either primary. An unknown mode
    is refused before anything is generated or written."""
    catalogue = load_catalogue()
    agent = agent_memory(tmp_path / "agent")
    indexer = TranscriptIndexer(agent)
    player, _ = open_player(tmp_path / "player", HashEmbedder())
    ring = _ScriptedRing(["Said in the clasp.", "never spoken"])
    runtime = NpcRuntime(catalogue, {"casual": ring}, memory=player, transcripts=indexer)
    try:
        runtime.speak(_request(catalogue), mode="in_between")
        try:
            runtime.speak(_request(catalogue), mode="sideways")
            raise AssertionError("an unknown mode was accepted")
        except NimmerError as exc:
            assert "'sideways' is not one of 'realworld', 'in_between'" in str(exc)
        assert len(ring.texts) == 1  # refused before the ring spoke
        assert indexer.flush(timeout=30)
        assert [e.text for e in player.entries()] == []  # the player's primary
        clasp = player.retrieve("Said in the clasp", mode="in_between")
        # the NPC's line and the player's (issue 40: both lines of a turn are remembered)
        assert sorted(r.entry.text for r in clasp) == ["Said in the clasp.", "Where did the water go?"]
        assert _texts(agent) == [] and any("Said in the clasp." in t for t in _texts(agent, "clasp"))
        assert Exchange("s", (), (("player", "x"),), 1.0, "in_between").mode is Mode.IN_BETWEEN
        agent.add([CrystalSpec("a clasp note", "note")], "in_between")
        assert "a clasp note" in _texts(agent, "clasp") and "a clasp note" not in _texts(agent)
    finally:
        indexer.close()
        agent.close()
        player.close()


def test_episodes_are_never_exported_as_anyones_words(tmp_path: Path) -> None:
    """An episode holds the player's line and the NPC's reply (speaker "exchange"): consent's
    export skips it, so the NPC's words never leave as the player's. An entry of one speaker
    (the player's own line) is still shared, redacted."""
    catalogue = load_catalogue()
    folder = tmp_path / "device"  # the agent folder is the player's folder: its consent record
    agent = agent_memory(folder)
    write_profile(folder, "p-4711", "Mara Quell")
    grant(agent.memory, "A2_anonymized", now=1.0)
    indexer = TranscriptIndexer(agent)
    runtime = NpcRuntime(
        catalogue, {"casual": _ScriptedRing(["The cistern under the tannery."])}, transcripts=indexer
    )
    runtime.speak(_request(catalogue, "I am Mara Quell, where did the water go?"))
    indexer.submit(
        Exchange("s", ("t9",), (("player", "Mara Quell keeps bees"),), 2.0, data_category="casual_dialog")
    )
    assert indexer.flush(timeout=30)
    shared = training_examples(agent.memory, "A2_anonymized", "p-4711", "Mara Quell")
    try:
        assert any("tannery" in t for t in _texts(agent))  # the episode is stored and searchable
        assert shared == [
            {
                "text": "player: [player] keeps bees",
                "speaker": "player",
                "data_category": "casual_dialog",
                "semantic_type": "episode",
                "memory_class": "working",
            }
        ]
    finally:
        indexer.close()
        agent.close()


def test_excluded_casual_dialog_and_in_between_episodes_are_never_exported(tmp_path: Path) -> None:
    catalogue = load_catalogue()
    folder = tmp_path / "device"
    agent = agent_memory(folder)
    write_profile(folder, "p-4711", "Mara Quell")
    grant(agent.memory, "A2_anonymized", now=1.0)
    exclude(agent.memory, "casual_dialog")
    indexer = TranscriptIndexer(agent)
    runtime = NpcRuntime(
        catalogue, {"casual": _ScriptedRing(["Realworld reply.", "Clasp reply."])}, transcripts=indexer
    )
    runtime.speak(_request(catalogue))
    runtime.speak(_request(catalogue, "in the clasp now"), mode=Mode.IN_BETWEEN)
    indexer.submit(Exchange("s", ("t9",), (("player", "my own line"),), 2.0, data_category="casual_dialog"))
    assert indexer.flush(timeout=30)
    try:
        assert training_examples(agent.memory, "A2_anonymized", "p-4711", "Mara Quell") == []
        grant(
            agent.memory, "A2_anonymized", ("casual_dialog", "companion_session"), now=2.0
        )  # exclusion kept
        assert training_examples(agent.memory, "A2_anonymized", "p-4711", "Mara Quell") == []
        assert not any("Clasp reply" in t for t in _texts(agent))
        assert any("Clasp reply" in t for t in _texts(agent, "clasp"))
    finally:
        indexer.close()
        agent.close()


def test_primary_turn_ids_do_not_reveal_in_between_turns(tmp_path: Path) -> None:
    catalogue = load_catalogue()
    agent = agent_memory(tmp_path / "agent")
    indexer = TranscriptIndexer(agent)
    runtime = NpcRuntime(
        catalogue, {"casual": _ScriptedRing(["a", "b", "c", "d"])}, transcripts=indexer, session_id="s"
    )
    runtime.speak(_request(catalogue))
    runtime.speak(_request(catalogue, "clasp words"), mode=Mode.IN_BETWEEN)
    runtime.speak(_request(catalogue, "back outside"))
    runtime.speak(_request(catalogue, "clasp again"), mode="in_between")
    assert indexer.flush(timeout=30)
    try:
        assert _turn_ids(agent) == [["oran-t1"], ["oran-t2"]]
        assert _turn_ids(agent, "clasp") == [["oran-clasp-t1"], ["oran-clasp-t2"]]
    finally:
        indexer.close()
        agent.close()


def test_without_player_memory_exchanges_are_still_indexed(tmp_path: Path) -> None:
    """memory=None means no knowledge stack and no write-back to a player store; the transcript
    indexer, when given, still indexes every exchange (the documented behaviour)."""
    catalogue = load_catalogue()
    agent = agent_memory(tmp_path / "agent")
    indexer = TranscriptIndexer(agent)
    runtime = NpcRuntime(catalogue, {"casual": _ScriptedRing(["x"])}, memory=None, transcripts=indexer)
    runtime.speak(_request(catalogue))
    assert indexer.flush(timeout=30)
    try:
        assert _texts(agent) == ["player: Where did the water go?\nnpc:oran: x"]
    finally:
        indexer.close()
        agent.close()


def test_an_exchange_is_embedded_by_what_was_said_without_the_speaker_labels(tmp_path: Path) -> None:
    """The same "player:" / "npc:..." labels on every exchange pulled all vectors together
    (benchmarks/bench_conversation_memory.py); the stored text keeps them, the vector does not,
    and an exchange split to fit the entry limit is embedded part by part the same way."""
    embedder = CountingEmbedder()
    agent = agent_memory(tmp_path, Clock(), embedder)
    exchange = Exchange("s1", ("t1",), (("player", "my sister is Greta"), ("npc:companion", "noted")), 1.8e9)
    index_exchanges(agent, [exchange])
    assert embedder.texts == ["my sister is Greta\nnoted"]
    (crystal,) = agent.crystals()
    assert crystal.text == "player: my sister is Greta\nnpc:companion: noted"
    long = Exchange("s1", ("t2",), (("player", "word " * 300), ("npc:companion", "aye " * 300)), 1.8e9)
    parts = exchange_specs(long, max_chars=1000)
    assert len(parts) > 2 and all(p.text.startswith("[exchange part") for p in parts)
    assert all(p.embed_text and "player" not in p.embed_text and "npc:" not in p.embed_text for p in parts)
    assert all(len(p.text) <= 1000 for p in parts)
    agent.close()
