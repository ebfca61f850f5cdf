"""Privacy and lifecycle properties of crystals under random operation sequences (hypothesis):
what is said in the in-between stays in the clasp store, consent's export never returns what it
excludes, frozen crystals never change and expired ones never come back."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nimmer_train.agent.consolidation import consolidate
from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.ingestion import Exchange, index_exchanges
from nimmer_train.memory.consent import (
    TIERS,
    ConsentRecord,
    set_consent,
    shareable_categories,
    training_examples,
)
from nimmer_train.memory.entries import DATA_CATEGORIES
from nimmer_train.memory.player_memory import Mode
from tests.helpers.memory import Clock, agent_memory

DAY = 86400.0
operations = st.lists(
    st.one_of(
        st.tuples(st.just("note"), st.sampled_from(list(Mode)), st.sampled_from(["experience", "directive"])),
        st.tuples(st.just("exchange"), st.sampled_from(list(Mode)), st.integers(0, 3)),
        st.tuples(st.just("consolidate"), st.floats(0, 120 * DAY), st.just(None)),
        st.tuples(st.just("search"), st.sampled_from(list(Mode)), st.just(None)),
    ),
    min_size=1,
    max_size=14,
)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=operations)
def test_random_sequences_keep_the_clasp_boundary_and_the_lifecycle(tmp_path_factory, ops) -> None:
    folder = tmp_path_factory.mktemp("agent")
    clock = Clock()
    agent = agent_memory(folder, clock)
    agent.add([CrystalSpec("Grind the beans, then pour slowly.", "skill", lifespan="permanent")])
    frozen_sql = (  # searches count accesses on a skill; nothing else about it may change
        "SELECT e.id, e.text, c.lifecycle, c.importance, c.valid_to, c.lifespan FROM crystals c "
        "JOIN entries e ON e.id = c.entry_id WHERE c.origin = 'skill'"
    )
    frozen = agent.db("primary").execute(frozen_sql).fetchall()
    for n, (op, arg, extra) in enumerate(ops):
        clock.now += 60
        secret = f"inbetween-secret-{n}"
        if op == "note":
            said = secret if arg is Mode.IN_BETWEEN else f"plain note {n}"
            agent.working_memory_note(f"{said} about the lamps", kind=extra, mode=arg)
        elif op == "exchange":
            said = secret if arg is Mode.IN_BETWEEN else f"plain words {n}"
            index_exchanges(agent, [Exchange(f"s{extra}", (f"t{n}",), (("player", said),), clock.now, arg)])
        elif op == "consolidate":
            clock.now += arg
            consolidate(agent)
        else:
            query = f"{secret} lamps" if arg is Mode.IN_BETWEEN else f"plain lamps {n}"
            agent.memory_search(query, min_score=-1, mode=arg)
    primary = agent.db("primary")
    texts = " ".join(r[0] for r in primary.execute("SELECT text FROM entries"))
    logged = " ".join(r[0] for r in primary.execute("SELECT query FROM memory_search_log"))
    scratch = folder / "memory" / "scratch.md"
    on_disk = scratch.read_text() if scratch.exists() else ""
    assert "inbetween-secret" not in texts + on_disk
    assert primary.execute("SELECT count(*) FROM entries WHERE data_category = 'clasp'").fetchone()[0] == 0
    assert "inbetween-secret" not in logged  # a clasp-mode query is logged in the clasp store
    assert primary.execute(frozen_sql).fetchall() == frozen
    for store in agent.existing_stores():
        rows = agent.db(store).execute("SELECT event_uid, to_state FROM crystal_audit ORDER BY id").fetchall()
        seen_expired: set[str] = set()
        for entry_id, state in rows:
            if entry_id in seen_expired:
                assert state == "purged"  # expired never comes back
            if state == "expired":
                seen_expired.add(entry_id)
    agent.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    categories=st.lists(
        st.sampled_from([c for c in DATA_CATEGORIES if c != "clasp"]), min_size=1, max_size=4
    ),
    record=st.builds(
        ConsentRecord,
        st.sampled_from(TIERS),
        st.lists(st.sampled_from(DATA_CATEGORIES)).map(tuple),
        st.lists(st.sampled_from(DATA_CATEGORIES)).map(tuple),
        st.none(),
        st.none() | st.just(1.0),
    ),
    tier=st.sampled_from(TIERS),
)
def test_consent_export_never_returns_an_excluded_crystal(tmp_path_factory, categories, record, tier) -> None:
    folder = tmp_path_factory.mktemp("agent")
    for n, category in enumerate(categories):
        agent = agent_memory(folder)
        agent.data_category = category
        agent.working_memory_note(f"note {n} by Marta in {category}")
        agent.working_memory_note(f"clasp note {n} by Marta", mode=Mode.IN_BETWEEN)
        agent.close()
    agent = agent_memory(folder)
    set_consent(agent.memory, record)
    shared = training_examples(agent.memory, tier, "marta-77", "Marta")
    allowed = shareable_categories(record, tier)
    assert {row["data_category"] for row in shared} <= allowed
    assert all("clasp note" not in row["text"] and "Marta" not in row["text"] for row in shared)
    expected = [c for c in categories if c in allowed]
    assert len(shared) == len(expected)
    agent.close()


def test_consent_export_skips_forgotten_crystals(tmp_path_factory) -> None:
    folder = tmp_path_factory.mktemp("agent")
    clock = Clock()
    agent = agent_memory(folder, clock)
    agent.data_category = "casual_dialog"
    agent.working_memory_note("an idle remark", 0.5)
    clock.now += 200 * DAY
    consolidate(agent)
    set_consent(agent.memory, ConsentRecord("A2_anonymized", ("casual_dialog",)))
    assert training_examples(agent.memory, "A2_anonymized", "p-1", "Marta") == []
    agent.close()
