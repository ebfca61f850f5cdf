"""Knowledge crystals: the lifecycle transition function and its audit rows, the schema migration
of existing stores, Ebbinghaus importance and semantic-type inference."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimmer_train.agent.crystals import (
    EDGES,
    LIFECYCLES,
    CrystalSpec,
    IllegalTransition,
    infer_semantic_type,
    transition,
)
from nimmer_train.agent.importance import ImportancePolicy, importance, importance_many
from nimmer_train.memory.db import connect
from nimmer_train.memory.player_memory import PRIMARY_FILE, PlayerMemory
from nimmer_train.memory.schema import PRIMARY_MIGRATIONS
from tests.helpers.memory import Clock, HashEmbedder, agent_memory, write_v3_store

DAY = 86400.0


def _crystal_in(agent, state: str) -> int:  # noqa: ANN001
    """A crystal driven along allowed edges to ``state`` (skills are born frozen)."""
    origin = "skill" if state == "frozen" else "note"
    lifespan = "permanent" if origin == "skill" else "decay"
    (entry_id,) = agent.add([CrystalSpec(f"a crystal bound for {state}", origin, lifespan=lifespan)])
    path = {
        "generated": [],
        "frozen": [],
        "activated": ["activated"],
        "consolidated": ["consolidated"],
        "archived": ["archived"],
        "expired": ["expired"],
    }[state]
    for step in path:
        agent.move("primary", [entry_id], step, "test setup")
    return entry_id


@pytest.mark.parametrize("start", LIFECYCLES)
@pytest.mark.parametrize("target", LIFECYCLES)
def test_transition_allows_exactly_the_edges_and_audits_each_move(tmp_path: Path, start, target) -> None:
    agent = agent_memory(tmp_path)
    entry_id = _crystal_in(agent, start)
    db = agent.db("primary")
    audits = db.execute("SELECT count(*) FROM crystal_audit WHERE entry_id = ?", (entry_id,)).fetchone()[0]
    if target in EDGES[start]:
        with db:
            assert transition(db, entry_id, target, "table test", 5.0) == start
        rows = db.execute(
            "SELECT from_state, to_state, reason FROM crystal_audit WHERE entry_id = ? ORDER BY id",
            (entry_id,),
        ).fetchall()
        assert len(rows) == audits + 1 and rows[-1] == (start, target, "table test")
    else:
        with pytest.raises(IllegalTransition, match=f"{start} -> {target} is not allowed"):
            transition(db, entry_id, target, "table test", 5.0)
        after = db.execute("SELECT count(*) FROM crystal_audit WHERE entry_id = ?", (entry_id,)).fetchone()[0]
        assert after == audits
    lifecycle = db.execute("SELECT lifecycle FROM crystals WHERE entry_id = ?", (entry_id,)).fetchone()[0]
    assert lifecycle == (target if target in EDGES[start] else start)
    agent.close()


def test_every_crystal_has_one_creation_audit_row_and_skills_are_born_frozen(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path)
    ids = agent.add(
        [
            CrystalSpec("a fact", "file", path="MEMORY.md"),
            CrystalSpec("how to bake", "skill", lifespan="permanent"),
        ]
    )
    rows = (
        agent.db("primary")
        .execute("SELECT entry_id, from_state, to_state FROM crystal_audit ORDER BY entry_id")
        .fetchall()
    )
    assert rows == [(ids[0], None, "generated"), (ids[1], None, "frozen")]
    with pytest.raises(Exception, match="ttl_s"):
        agent.add([CrystalSpec("no ttl given", "note", lifespan="ttl")])
    uids = [agent.uid("primary", i) for i in ids]
    (insight,) = agent.add(
        [CrystalSpec("facts and skills meet at the bakery", "dream", source_ids=tuple(uids))]
    )
    (found,) = agent.crystals("primary", "e.id = ?", (insight,))
    assert (found.semantic_type, found.origin, found.lifecycle) == ("insight", "dream", "generated")
    assert agent.memory.entries()[-1].source_ids == tuple(uids)  # part 2's dream path
    agent.close()


def test_a_v3_store_migrates_with_nothing_lost(tmp_path: Path) -> None:
    rows = [
        ("u1", "The cistern keeper hums at dawn.", "working", "casual_dialog"),
        ("u2", "Marta's first memory of the river.", "cornerstone", "memorial_archive"),
        ("u3", "A passing word at the gate.", "volatile", "casual_dialog"),
    ]
    write_v3_store(tmp_path, rows)
    before = connect(tmp_path / PRIMARY_FILE).execute("SELECT * FROM entries ORDER BY id").fetchall()
    agent = agent_memory(tmp_path)
    db = agent.db("primary")
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(PRIMARY_MIGRATIONS)
    assert db.execute("SELECT * FROM entries ORDER BY id").fetchall() == before
    crystals = db.execute(
        "SELECT e.event_uid, c.lifecycle, c.lifespan FROM crystals c JOIN entries e ON e.id = c.entry_id "
        "ORDER BY e.id"
    ).fetchall()
    assert crystals == [
        ("u1", "generated", "decay"),
        ("u2", "generated", "permanent"),
        ("u3", "generated", "decay"),
    ]
    assert db.execute("SELECT count(*) FROM crystal_audit").fetchone()[0] == 3
    hits = agent.memory_search("cistern keeper", min_score=-1)
    assert hits[0]["id"] == "u1"  # the migrated text is in the keyword index and the vector index
    # writers that predate crystals still produce them (the insert trigger)
    PlayerMemory(tmp_path, HashEmbedder(), clock=Clock()).write(
        "later line", "npc", "working", "casual_dialog"
    )
    assert db.execute("SELECT count(*) FROM crystals").fetchone()[0] == 4
    agent.close()


def test_importance_golden_values_from_the_reference_constants() -> None:
    policy = ImportancePolicy()

    def forgotten_after_days(n: int, valence: float) -> float:
        start = importance("fact", n, 0.0, valence)
        rate = math.log(2) / policy.half_life_s * (1 - 0.5 * abs(valence))
        return math.log(start / policy.forget_threshold) / rate / DAY

    assert forgotten_after_days(0, 0.0) == pytest.approx(51.0, abs=0.1)
    assert forgotten_after_days(0, 1.0) == pytest.approx(102.0, abs=0.2)
    assert forgotten_after_days(5, 0.0) == pytest.approx(82.0, abs=0.3)
    assert importance("fact", 0, 50.9 * DAY, 0.0) > 0.02 > importance("fact", 0, 51.1 * DAY, 0.0)
    # frozen / permanent / cornerstone: constant in time
    assert importance("skill", 0, 0.0, 0.0, decays=False) == importance(
        "skill", 0, 1e4 * DAY, 0.0, decays=False
    )


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["fact", "goal", "episode", "preference"]),
    n=st.integers(0, 50),
    since=st.floats(0, 400 * DAY),
    valence=st.floats(-1, 1),
    base=st.floats(0, 1),
    extra=st.floats(0, 100 * DAY),
)
def test_importance_is_monotone_and_matches_its_vector_form(kind, n, since, valence, base, extra) -> None:
    value = importance(kind, n, since, valence, base)
    assert 0 <= value <= 1
    assert importance(kind, n + 1, since, valence, base) >= value  # more accesses never hurt
    assert importance(kind, n, since + extra, valence, base) <= value  # time never helps
    stronger = min(1.0, abs(valence) + 0.1)
    assert importance(kind, n, since, stronger, base) >= importance(kind, n, since, abs(valence), base)
    import numpy as np

    vector = importance_many(
        np.array([kind]),
        np.array([n]),
        np.array([since]),
        np.array([valence]),
        np.array([base]),
        np.array([True]),
    )
    assert vector[0] == pytest.approx(value, rel=1e-9, abs=1e-12)


LABELLED_TYPES = [
    ("I prefer my tea without milk", "note", "preference"),
    ("My favourite song is the ferry shanty", "transcript", "preference"),
    ("I really hate the night shift", "transcript", "preference"),
    ("My goal is to reopen the mill by autumn", "note", "goal"),
    ("We plan to cross the river at dawn", "transcript", "goal"),
    ("Step 1: boil the water, step 2: add the leaves", "file", "task_pattern"),
    ("The morning routine starts at the cistern", "file", "task_pattern"),
    ("My sister is married to the ferryman", "transcript", "relationship"),
    ("Her brother works at the docks", "file", "relationship"),
    ("The bridge collapsed last winter", "file", "fact"),
    ("We talked about the weather", "transcript", "episode"),
    ("A quiet evening", "note", "general"),
    ("Grind the beans finely", "skill", "skill"),
    ("Dreams of water connect the three districts", "dream", "insight"),
    ("I prefer to plan the routine with my brother", "note", "preference"),  # order decides ties
]


def test_semantic_type_inference_on_a_labelled_set() -> None:
    right = sum(infer_semantic_type(text, origin) == kind for text, origin, kind in LABELLED_TYPES)
    assert right / len(LABELLED_TYPES) >= 0.85
    assert infer_semantic_type("I prefer to plan the routine with my brother", "note") == "preference"
