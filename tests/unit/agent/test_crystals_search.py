"""memory_search (hybrid vector + FTS5 BM25, weighted RRF, recency/importance as tie-breakers,
supersession, the search log), memory_get
and working_memory_note (scratch.md, immediate search, directive supersession)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.crystals import CrystalSpec, supersede
from nimmer_train.agent.search import (
    SUPERSEDED,
    LiveIndex,
    SearchWeights,
    fts_query,
    fuse,
    weighted,
    without_days,
)
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import connect
from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.memory.player_memory import PRIMARY_FILE, Mode
from tests.helpers.memory import Clock, agent_memory

DISTRACTORS = [
    "The water pump in the east district failed again during the night.",
    "Pump maintenance is scheduled every second week by the wardens.",
    "The pump house smells of oil and rust after the rain.",
    "A new filter was fitted to the cistern pump last month.",
    "The pump crew complained about the long shifts.",
    "Someone stole copper pipes from the pump station.",
    "The pump's pressure gauge shows a slow leak.",
    "Children play near the old pump in the square.",
]


@pytest.fixture(scope="module")
def minilm() -> SentenceEmbedder:
    return SentenceEmbedder()


def test_hybrid_search_finds_a_keyword_that_the_vectors_miss(tmp_path: Path, minilm) -> None:
    agent = AgentMemory(tmp_path, minilm, clock=Clock())
    agent.add([CrystalSpec(t, "note") for t in DISTRACTORS])
    agent.add([CrystalSpec("Invoice 88213 was paid in copper coins.", "note")])
    query = "pressure gauge leak report 88213"
    hybrid = agent.memory_search(query, max_results=2, min_score=0.99, record_access=False)
    vector_only = agent.memory_search(query, max_results=4, min_score=-1, use_text=False)
    assert any("88213" in h["text"] for h in hybrid)  # keyword hits pass min_score
    assert all("88213" not in h["text"] for h in vector_only)
    agent.close()


def test_search_excludes_superseded_and_expired_unless_asked(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    old, gone, _live = agent.add(
        [
            CrystalSpec("the ferry leaves from pier four", "note"),
            CrystalSpec("the ferry leaves from pier nine", "note"),
            CrystalSpec("the ferry leaves from pier two", "note"),
        ]
    )
    other = connect(tmp_path / PRIMARY_FILE)  # another process's connection, as the CLI's would be
    with other:
        other.execute("UPDATE crystals SET valid_to = 1, superseded_by = 'x' WHERE entry_id = ?", (old,))
    other.close()
    agent.move("primary", [gone], "expired", "test")
    texts = {h["text"] for h in agent.memory_search("ferry pier", min_score=-1)}
    assert texts == {"the ferry leaves from pier two"}  # another connection's update reloads the index
    wider = agent.memory_search("ferry pier", min_score=-1, include_superseded=True, include_expired=True)
    assert {h["text"] for h in wider} == {
        "the ferry leaves from pier four",
        "the ferry leaves from pier nine",
        "the ferry leaves from pier two",
    }
    agent.close()


def test_search_logs_scores_counts_accesses_and_respects_limits(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    ids = agent.add([CrystalSpec(f"note {i} about the lantern market", "note") for i in range(10)])
    hits = agent.memory_search("lantern market", max_results=4, min_score=-1)
    assert len(hits) == 4 and [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    assert all(0 < h["score"] <= 1 for h in hits)
    db = agent.db("primary")
    row = db.execute(
        "SELECT query, results, top_score, mean_score, top_similarity FROM memory_search_log"
    ).fetchone()
    assert row[0] == "lantern market" and row[1] == 4
    assert row[2] == pytest.approx(hits[0]["score"], abs=1e-5)
    assert row[3] == pytest.approx(sum(h["score"] for h in hits) / 4, abs=1e-5)
    states = dict(
        db.execute(f"SELECT entry_id, lifecycle FROM crystals WHERE entry_id IN ({','.join(map(str, ids))})")
    )
    assert sorted(states.values()).count("activated") == 4
    assert db.execute("SELECT sum(access_count) FROM entries").fetchone()[0] == 4
    assert agent.memory_search("zebra quantum", min_score=0.99) == []  # nothing answers: empty, still logged
    assert db.execute("SELECT count(*), max(results = 0) FROM memory_search_log").fetchone() == (2, 1)
    with pytest.raises(NimmerError, match="query"):
        agent.memory_search("   ")
    agent.close()


def test_recency_ranks_the_newer_of_two_equal_facts_first(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    agent.add(
        [CrystalSpec("the user lives near the salt market", "transcript", valid_from=clock.now - 90 * 86400)]
    )
    agent.add([CrystalSpec("the user lives near the salt market", "transcript", valid_from=clock.now)])
    first = agent.memory_search("where does the user live", min_score=-1)[0]
    assert first["valid_from"] == clock.now
    agent.close()


def test_fusion_and_keyword_query_helpers() -> None:
    w = SearchWeights()
    fused = fuse([(1, 0.9), (2, 0.8), (3, 0.7)], [(3, 1.0), (4, 1.0)], w)
    assert max(fused.values()) == fused[3] and fused[1] > fused[2]
    assert fuse([(7, 0.5)], [(7, 1.0)], w)[7] == pytest.approx(1.0)
    weak = fuse([(1, 0.9), (2, 0.8)], [(2, 0.05)], w)  # a keyword hit on a common word barely counts
    assert weak[1] > weak[2]
    tied = fuse([(1, 0.8), (2, 0.8), (3, 0.7)], [], w)  # the same cosine, the same rank
    assert tied[1] == tied[2] > tied[3]
    # recency, importance and supersession are tie-breakers worth about a place, not a vote
    first, second = fuse([(1, 0.9), (2, 0.8)], [], w).values()
    assert weighted(second, 1.0, 0.5, w) < weighted(first, 0.0, 0.5, w)
    assert weighted(second, 0.0, 0.5, w) < weighted(second, 1.0, 0.5, w)
    assert weighted(first, 0.0, 0.5, w, superseded=True) < weighted(second, 0.0, 0.5, w)
    assert fts_query('who is "Marta" AND NOT the; DROP') == '"marta" OR "not" OR "drop"'
    assert fts_query("what is the") is None


def _exchange(said: str, at: float) -> CrystalSpec:
    return CrystalSpec(f"user: {said}\nassistant: Noted! Anything else?", "transcript", valid_from=at)


SMALL_TALK = [
    "My friend Ines told me her brother is moving to Porto.",
    "Mara and her sister went to the market today.",
    "I watched a documentary about volcanoes yesterday.",
    "Do you think it will rain on the weekend?",
    "My neighbour's kids are loud, they are three siblings.",
    "Traffic in Oslo was terrible this morning.",
]


def test_fresh_small_talk_does_not_bury_an_older_answer(tmp_path: Path, minilm) -> None:
    """Recency breaks ties; it does not lift the last session's chatter over a clear answer
    from a month ago (the old fusion's +15 % recency factor did, at 1.6 % per RRF place)."""
    clock = Clock()
    agent = AgentMemory(tmp_path, minilm, clock=clock)
    agent.add([_exchange("By the way, my sister is called Greta.", clock.now - 30 * 86400)])
    agent.add([_exchange(t, clock.now - 3600) for t in SMALL_TALK])
    for use_text in (True, False):
        hits = agent.memory_search("What is my sister's name?", 3, -1, use_text=use_text, record_access=False)
        assert "Greta" in hits[0]["text"]
    agent.close()


def test_an_update_ranks_above_the_statement_it_replaces(tmp_path: Path, minilm) -> None:
    clock = Clock()
    agent = AgentMemory(tmp_path, minilm, clock=clock)
    agent.add([_exchange("My car is white.", clock.now - 40 * 86400)])
    agent.add([_exchange(t, clock.now - 30 * 86400) for t in SMALL_TALK])
    agent.add([_exchange("I had my car repainted blue, it used to be white.", clock.now - 20 * 86400)])
    for query in ("What colour is my car currently?", "What colour is my car?"):
        top = agent.memory_search(query, 3, -1, record_access=False)
        assert "repainted blue" in top[0]["text"] and "My car is white" in top[1]["text"]
    agent.close()


def test_a_superseded_fact_ranks_below_its_successor_when_included(tmp_path: Path) -> None:
    """Asked for history, the search still puts the fact in force first at equal relevance."""
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    old, new = agent.add(
        [
            CrystalSpec("the ferry leaves from pier four", "note", valid_from=clock.now - 20 * 86400),
            CrystalSpec("the ferry leaves from pier nine", "note", valid_from=clock.now - 20 * 86400),
        ]
    )
    with agent.db("primary") as db:
        supersede(db, old, new, clock.now - 10 * 86400)
    agent.index("primary").set_state(old, SUPERSEDED)
    hits = agent.memory_search("ferry pier", min_score=-1, include_superseded=True, record_access=False)
    assert [h["text"] for h in hits] == ["the ferry leaves from pier nine", "the ferry leaves from pier four"]
    agent.close()


def test_an_exact_keyword_hit_in_an_older_session_still_surfaces(tmp_path: Path, minilm) -> None:
    clock = Clock()
    agent = AgentMemory(tmp_path, minilm, clock=clock)
    agent.add([_exchange("The boatman who took us across was Quillon Varga.", clock.now - 60 * 86400)])
    agent.add([_exchange(t, clock.now - 3600) for t in [*SMALL_TALK, *DISTRACTORS]])
    hits = agent.memory_search("Did Varga ever mention the harbour?", 3, 0.5, record_access=False)
    assert any("Varga" in h["text"] for h in hits)
    agent.close()


def test_memory_get_returns_exact_lines_and_names_bad_arguments(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    (tmp_path / "memory").mkdir()
    (tmp_path / "memory" / "people.md").write_text("line one\nline two\nline three\nline four\n")
    got = agent.memory_get("memory/people.md", 2, 2)
    assert got == {"path": "memory/people.md", "from": 2, "lines": 2, "text": "line two\nline three"}
    assert agent.memory_get("memory/people.md")["lines"] == 4
    with pytest.raises(NimmerError, match="path: '../primary.sqlite'"):
        agent.memory_get("../primary.sqlite")
    with pytest.raises(NimmerError, match="path: 'primary.sqlite' is not a memory file"):
        agent.memory_get("primary.sqlite")
    with pytest.raises(NimmerError, match="from: 0"):
        agent.memory_get("memory/people.md", 0)
    with pytest.raises(NimmerError, match="does not exist"):
        agent.memory_get("memory/nobody.md")
    agent.close()


def test_notes_are_searchable_at_once_and_directives_supersede(tmp_path: Path, minilm) -> None:
    clock = Clock()
    agent = AgentMemory(tmp_path, minilm, clock=clock)
    agent.add([CrystalSpec(t, "note") for t in DISTRACTORS])
    out = agent.working_memory_note("The user's daughter starts school in the harbour district", 0.8)
    assert out["stored"] == "primary" and out["line"] == 1
    line = (tmp_path / "memory" / "scratch.md").read_text().splitlines()[0]
    assert re.fullmatch(
        r"- \[\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ\] \(importance: 0\.80, type: experience\) .+", line
    )
    top = agent.memory_search("The user's daughter starts school in the harbour district")[0]
    assert top["id"] == out["id"] and top["semantic_type"] == "episode"

    clock.now += 60
    first = agent.working_memory_note("Always call the user Sam.", kind="directive")
    unrelated = agent.working_memory_note("Answer in short sentences.", kind="directive")
    clock.now += 60
    second = agent.working_memory_note("Always call the user Alex.", kind="directive")
    profile = agent.memory_status()["user_profile"]
    assert profile == ["Answer in short sentences.", "Always call the user Alex."]
    db = agent.db("primary")
    closed = db.execute(
        "SELECT e.event_uid, c.valid_to, c.superseded_by, c.lifecycle FROM crystals c "
        "JOIN entries e ON e.id = c.entry_id WHERE c.valid_to IS NOT NULL"
    ).fetchall()
    assert closed == [(first["id"], clock.now, second["id"], "generated")]  # closed, not expired or deleted
    hits = {h["id"] for h in agent.memory_search("what should I call the user", min_score=-1)}
    assert first["id"] not in hits and second["id"] in hits and unrelated["id"] in hits
    # re-ingesting scratch.md changes nothing (the file is the source of truth)
    from nimmer_train.agent.ingestion import ingest_file

    assert ingest_file(agent, "memory/scratch.md") == {"added": 0, "kept": 4, "expired": 0, "skipped": 0}
    agent.close()


def test_notes_in_the_in_between_stay_in_the_clasp_store(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    out = agent.working_memory_note("what she whispered at the clasp", mode=Mode.IN_BETWEEN)
    assert out["stored"] == "clasp" and out["file"] is None
    assert not (tmp_path / "memory" / "scratch.md").exists()
    assert agent.db("primary").execute("SELECT count(*) FROM entries").fetchone()[0] == 0
    assert agent.memory_search("whispered", min_score=-1) == []
    hits = agent.memory_search("whispered", min_score=-1, mode=Mode.IN_BETWEEN)
    assert hits[0]["store"] == "clasp"
    assert agent.db("primary").execute("SELECT count(*) FROM memory_search_log").fetchone()[0] == 1
    assert agent.db("clasp").execute("SELECT query FROM memory_search_log").fetchone()[0] == "whispered"
    agent.close()


def test_entries_pruned_by_the_player_store_leave_search(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    agent.add([CrystalSpec("the old mill wheel creaks", "note"), CrystalSpec("the mill pond froze", "note")])
    agent.memory_search("mill", min_score=-1, record_access=False)  # the index is loaded
    (gone,) = [e.event_uid for e in agent.memory.entries() if "wheel" in e.text]
    agent.memory.delete([gone])  # issue 5's pruning path, on the same connection
    assert [h["text"] for h in agent.memory_search("mill wheel", min_score=-1)] == ["the mill pond froze"]
    assert agent.db("primary").execute("SELECT count(*) FROM crystals").fetchone()[0] == 1  # cascade
    agent.close()


def test_a_large_store_searches_by_cells_and_still_finds_new_and_only_live_rows() -> None:
    """From ``ann_min_rows`` rows the live index scans the query's cells (vector_cells.py): the
    planted nearest row is found, a row added after the cells were trained is found at once, and
    a superseded row is never returned."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((50, 384)).astype(np.float32)
    rows = centres[rng.integers(0, 50, 4000)] + 0.6 * rng.standard_normal((4000, 384)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    index = LiveIndex()
    index.ann_min_rows = 1000
    for i, v in enumerate(rows, start=1):
        index.add(i, v)
    mask = index.mask(False, False)
    q = rows[123]
    assert index.nearest(q, 5, mask)[0][0] == 124
    assert index.cells is not None and len(index.cells.rows(q)) < len(rows) / 2
    index.add(9999, -q)
    assert index.nearest(-q, 1, index.mask(False, False))[0][0] == 9999
    index.set_state(124, SUPERSEDED)
    assert 124 not in {i for i, _ in index.nearest(q, 10, index.mask(False, False))}
    assert index.nearest(q, 1, index.mask(True, False))[0][0] == 124


def test_a_named_day_selects_rows_and_the_rest_of_the_words_rank_them(tmp_path: Path) -> None:
    """The day a query names is taken out of the words that rank that day's rows, and a row of
    that day passes ``min_score`` even with a low cosine (the query asked for the day)."""
    assert without_days("What did I do on 8 May 2027?") == "What did I do on?"
    assert without_days("what happened May 8th, 2027 at the mill") == "what happened at the mill"
    day = 1_809_734_400.0  # 8 May 2027 00:00 UTC
    agent = agent_memory(tmp_path, Clock(day + 30 * 86400))
    agent.add([CrystalSpec("zebra quartz lantern", "note", valid_from=day + 3600)])
    agent.add([CrystalSpec("what did I do on", "note", valid_from=day - 86400)])
    hits = agent.memory_search("What did I do on 8 May 2027?", 2, 0.5, record_access=False)
    assert [h["text"] for h in hits][:1] == ["zebra quartz lantern"]
    agent.close()
