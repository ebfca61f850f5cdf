"""Player memory stores: writes, validation, mode-aware retrieval, the clasp boundary, consent,
and crash durability."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nimmer_train.memory.consent import TIERS, ConsentRecord, set_consent, training_examples
from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.memory.entries import DATA_CATEGORIES, MEMORY_CLASSES, InvalidEntry
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from tests.helpers import REPO
from tests.helpers.memory import Clock, HashEmbedder

EMBED = HashEmbedder()


def _memory(folder: Path, clock: Clock | None = None) -> PlayerMemory:
    return PlayerMemory(folder, EMBED, clock=clock or Clock())


def test_real_embeddings_retrieve_by_meaning(tmp_path: Path) -> None:
    memory = PlayerMemory(tmp_path / "p1", SentenceEmbedder(), clock=Clock())
    for text in (
        "The ration line moved to the east gate last week.",
        "Ilse sold me buttons at the market and laughed.",
        "The wardens doubled the night patrols near the cisterns.",
    ):
        memory.write(text, "npc:preacher", "working", "casual_dialog")
    top = memory.retrieve("Who was selling things at the market?", k=1)
    assert top[0].entry.text.startswith("Ilse sold me buttons") and top[0].store == "primary"
    assert memory.retrieve("guards walking at night", k=1)[0].entry.text.startswith("The wardens")
    assert top[0].entry.access_count == 1


def test_an_embedder_travels_by_name_and_embeds_the_same_after(tmp_path: Path) -> None:
    """A simulation ships the population, embedder included, with every message to its workers:
    pickled, the embedder is its model's name (not 90 MB of weights to unpickle each time), and the
    copy embeds exactly as the original."""
    import pickle

    embedder = SentenceEmbedder()
    shipped = pickle.dumps(embedder)
    assert len(shipped) < 1_000
    copy = pickle.loads(shipped)
    texts = ["the ferry bell rang at dusk", "salt on the east steps"]
    assert copy.dim == embedder.dim and np.array_equal(copy.embed(texts), embedder.embed(texts))


def test_combined_score_prefers_important_and_recent(tmp_path: Path) -> None:
    clock = Clock()
    memory = _memory(tmp_path / "p", clock)
    memory.write("the copper coil went missing", "npc", "working", "casual_dialog", importance=0.1)
    clock.now += 3600 * 200  # 200 hours later
    memory.write("the copper coil went missing!", "npc", "working", "casual_dialog", importance=0.9)
    hits = memory.retrieve("copper coil missing", k=2)
    assert [h.entry.importance for h in hits] == [0.9, 0.1]
    assert hits[0].recency == pytest.approx(1.0) and hits[1].recency == pytest.approx(0.995**200)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("", "text: empty"),
        ("   ", "text: empty"),
        ("x" * 5000, "over the limit of 4000"),
        (b"\xff\xfe bad", "invalid UTF-8"),
        ("lone \ud800 surrogate", "lone surrogate"),
    ],
)
def test_bad_text_is_rejected_and_nothing_changes(tmp_path: Path, text: str | bytes, field: str) -> None:
    memory = _memory(tmp_path / "p")
    memory.write("kept", "npc", "working", "casual_dialog")
    with pytest.raises(InvalidEntry, match=re.escape(field)):
        memory.write(text, "npc", "working", "casual_dialog")
    assert [e.text for e in memory.entries()] == ["kept"]


def test_bad_fields_are_rejected(tmp_path: Path) -> None:
    memory = _memory(tmp_path / "p")
    with pytest.raises(InvalidEntry, match="clasp entries are written only in IN_BETWEEN mode"):
        memory.write("x", "npc", "working", "clasp", mode=Mode.REALWORLD)
    with pytest.raises(InvalidEntry, match="memory_class"):
        memory.write("x", "npc", "eternal", "casual_dialog")
    with pytest.raises(InvalidEntry, match=r"unknown entry fields \['mood'\]"):
        memory.write("x", "npc", "working", "casual_dialog", mood="sad")
    memory.write("first", "npc", "working", "casual_dialog", event_uid="e-1")
    with pytest.raises(InvalidEntry, match="event_uid already stored"):
        memory.write("again", "npc", "working", "casual_dialog", event_uid="e-1")
    assert [e.text for e in memory.entries()] == ["first"]
    memory.delete(["e-1"])
    with pytest.raises(InvalidEntry, match="trait_engagement: unknown trait axis 'Eros'"):
        memory.write("x", "npc", "working", "casual_dialog", trait_engagement={"Eros": 1.0})
    assert memory.entries() == []


def test_only_the_clasp_module_opens_the_clasp_store() -> None:
    allowed = {
        "nimmer_train/memory/clasp.py": "defines",
        "nimmer_train/memory/player_memory.py": "in-between path",
        "nimmer_train/memory/llm_config.py": "names clasp.sealed in a lost key's recovery line",
    }
    # its files (sealed, the plaintext one it migrates, its lock) and the names that reach them
    pattern = re.compile(
        r"clasp\.(sqlite|sealed|lock)|CLASP_FILE|LEGACY_FILE|ClaspStore|clasp_exists|open_clasp"
    )
    offenders = []
    for folder in ("nimmer_train", "pipelines", "federated", "benchmarks"):
        for path in (REPO / folder).rglob("*.py") if (REPO / folder).exists() else []:
            rel = path.relative_to(REPO).as_posix()
            if pattern.search(path.read_text()) and rel not in allowed:
                offenders.append(rel)
    assert offenders == []
    store = (REPO / "nimmer_train/memory/player_memory.py").read_text()
    assert store.count("open_clasp(") == 1  # the one lazy opener behind Mode.IN_BETWEEN


entries = st.lists(
    st.tuples(
        st.sampled_from(DATA_CATEGORIES),
        st.sampled_from(MEMORY_CLASSES),
        st.sampled_from(list(Mode)),
        st.sampled_from(["Marta", "npc:scav", "marta-77"]),
    ),
    min_size=1,
    max_size=12,
).map(lambda rows: [(c, k, Mode.IN_BETWEEN if c == "clasp" else m, s) for c, k, m, s in rows])
records = st.builds(
    ConsentRecord,
    st.sampled_from(TIERS),
    st.lists(st.sampled_from(DATA_CATEGORIES)).map(tuple),
    st.lists(st.sampled_from(DATA_CATEGORIES)).map(tuple),
    st.none(),
    st.none() | st.just(1.0),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=entries, record=records, tier=st.sampled_from(TIERS))
def test_consent_never_leaks_clasp_excluded_or_identity(tmp_path_factory, rows, record, tier) -> None:
    memory = _memory(tmp_path_factory.mktemp("player"))
    for i, (category, klass, mode, speaker) in enumerate(rows):
        memory.write(f"Marta (marta-77) said line {i} about {category}", speaker, klass, category, mode=mode)
    set_consent(memory, record)
    shared = training_examples(memory, tier, player_id="marta-77", player_name="Marta")
    if (
        tier != record.sharing_tier
        or record.sharing_tier in ("opt_out", "A3_pseudonymous_full")
        or record.revoked_at is not None
    ):
        assert shared == []
    allowed = set(record.data_categories_shared) - set(record.excluded_categories) - {"clasp"}
    for example in shared:
        assert example["data_category"] in allowed
        assert "marta" not in (example["text"] + example["speaker"]).lower()
    memory.close()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(MEMORY_CLASSES),
            st.floats(0, 1),
            st.floats(0, 24 * 400),
            st.dictionaries(st.sampled_from(["Sophrosyne", "Philotes"]), st.floats(-1, 1)),
            st.sampled_from(["s1", "s2", None]),
        ),
        max_size=10,
    ),
    later_h=st.floats(0, 24 * 400),
)
def test_prune_is_a_function_of_store_and_clock(tmp_path_factory, rows, later_h) -> None:
    from nimmer_train.memory.pruning import DecayPolicy, to_prune

    stores = []
    for _ in range(2):
        clock = Clock()
        memory = _memory(tmp_path_factory.mktemp("player"), clock)
        for i, (klass, importance, age_h, engagement, session) in enumerate(rows):
            clock.now = Clock().now + age_h * 3600
            memory.write(
                f"memory {i}",
                "npc",
                klass,
                "casual_dialog",
                event_uid=f"m{i}",
                importance=importance,
                trait_engagement=engagement,
                session_id=session,
            )
        stores.append(memory.entries())
    now = Clock().now + later_h * 3600 + 24 * 400 * 3600
    first = to_prune(stores[0], now, "s2", DecayPolicy())
    assert (
        first
        == to_prune(stores[1], now, "s2", DecayPolicy())
        == to_prune(stores[0], now, "s2", DecayPolicy())
    )
    kept_classes = {e.memory_class for e in stores[0] if e.event_uid not in first}
    assert {
        e.memory_class for e in stores[0] if e.memory_class in ("cornerstone", "birthright")
    } <= kept_classes


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=entries, query=st.sampled_from(["line about dream_content", "Marta said", "clasp"]))
def test_retrieval_reads_clasp_only_in_between(tmp_path_factory, rows, query) -> None:
    memory = _memory(tmp_path_factory.mktemp("player"))
    for i, (category, klass, mode, speaker) in enumerate(rows):
        memory.write(f"line {i} about {category}", speaker, klass, category, mode=mode)
    in_between_writes = sum(mode is Mode.IN_BETWEEN for _, _, mode, _ in rows)
    realworld = memory.retrieve(query, k=20, mode=Mode.REALWORLD)  # k above the 12 rows at most
    assert len(realworld) == len(rows) - in_between_writes
    assert all(hit.store == "primary" for hit in realworld)
    in_between = memory.retrieve(query, k=20, mode=Mode.IN_BETWEEN)
    clasp_hits = [hit for hit in in_between if hit.store == "clasp"]
    assert len(in_between) == len(rows) and len(clasp_hits) == in_between_writes
    assert all(hit.entry.data_category == "clasp" for hit in clasp_hits)
    memory.close()


WRITER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from nimmer_train.memory.player_memory import PlayerMemory
    from tests.helpers.memory import HashEmbedder
    memory = PlayerMemory(Path(sys.argv[1]), HashEmbedder())
    i = 0
    while True:
        entry = memory.write(f"burst line {i}", "npc", "working", "casual_dialog", event_uid=f"uid-{i}")
        print(entry.event_uid, flush=True)
        i += 1
""")


def test_sigkill_during_a_write_burst_keeps_every_committed_write(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path / "p")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    committed = [proc.stdout.readline().strip() for _ in range(300)]
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored = {e.event_uid for e in _memory(tmp_path / "p").entries()}
    assert set(committed) <= stored


def test_prune_is_deterministic_and_respects_classes(tmp_path: Path) -> None:
    from nimmer_train.memory.pruning import DecayPolicy, on_character_death, prune

    def build(folder: Path) -> PlayerMemory:
        clock = Clock()
        memory = _memory(folder, clock)
        for klass in ("cornerstone", "birthright", "working"):
            memory.write(f"old {klass}", "npc:a", klass, "casual_dialog", importance=0.2)
        memory.write(
            "old but engaged",
            "npc:a",
            "working",
            "casual_dialog",
            importance=0.2,
            trait_engagement={"Philotes": 1.0, "Aletheia": -1.0},
        )
        memory.write("this session", "npc:b", "volatile", "casual_dialog", session_id="s2")
        memory.write("last session", "npc:b", "volatile", "casual_dialog", session_id="s1")
        clock.now += 3600 * 24 * 60  # sixty days on
        return memory

    first, second = build(tmp_path / "a"), build(tmp_path / "b")
    gone_texts = {e.event_uid: e.text for e in first.entries()}
    removed = prune(first, current_session="s2", policy=DecayPolicy())
    assert sorted(gone_texts[u] for u in removed) == ["last session", "old working"]
    assert [e.text for e in first.entries()] == [
        e.text for e in second.entries() if e.text not in ("last session", "old working")
    ]
    assert len(prune(second, "s2")) == len(removed)  # same clock, same result
    on_character_death(first, "npc:a")
    assert sorted(e.text for e in first.entries()) == ["old birthright", "old cornerstone", "this session"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_logout_login_and_corruption_restore(tmp_path: Path, seed: int) -> None:
    from nimmer_train.memory.sync import login, logout, open_player

    folder = tmp_path / "player"
    clock = Clock()
    memory, report = open_player(folder, EMBED, clock)
    assert not report.restored
    for i in range(20):
        memory.write(f"before snapshot {i}", "npc", "working", "casual_dialog")
    memory.write("a volatile aside", "npc", "volatile", "casual_dialog", session_id="s1")
    blob = logout(memory, tmp_path / "upstream.jsonl")
    lines = blob.read_text().splitlines()
    assert len(lines) == 20 and "volatile" not in blob.read_text()
    assert all(e.memory_class != "volatile" for e in memory.entries())  # the session ended
    fragment = {
        "event_uid": "canon-1",
        "text": "The gate fell.",
        "speaker": "world",
        "memory_class": "working",
        "data_category": "casual_dialog",
    }
    assert login(memory, [fragment, fragment]) == 1 and login(memory, [fragment]) == 0
    clock.now += 600
    memory.write("after snapshot", "npc", "working", "casual_dialog")
    memory.close()

    primary = folder / "primary.sqlite"
    data = bytearray(primary.read_bytes())
    rng = np.random.default_rng(seed)
    for offset in rng.integers(0, len(data) - 64, size=len(data) // 512):  # random garbage everywhere
        data[offset : offset + 64] = rng.bytes(64)
    primary.write_bytes(bytes(data))
    memory, report = open_player(folder, EMBED, clock)
    assert report.restored and report.lost_after == Clock().now
    texts = {e.text for e in memory.entries()}
    assert "before snapshot 19" in texts and "after snapshot" not in texts and "The gate fell." not in texts
    assert "writes after" in str(report)


def test_vector_index_follows_writes_and_deletes(tmp_path: Path) -> None:
    memory = _memory(tmp_path / "p")
    memory.write("alpha line about the gate", "npc", "working", "casual_dialog")
    assert len(memory.retrieve("gate", k=5)) == 1  # loads the in-memory index
    beta = memory.write("beta line about the gate", "npc", "working", "dream_content")
    assert {h.entry.text for h in memory.retrieve("gate", k=5)} == {
        "alpha line about the gate",
        "beta line about the gate",
    }
    assert [h.entry.text for h in memory.retrieve("gate", k=5, categories=["dream_content"])] == [beta.text]
    memory.delete([beta.event_uid])
    assert [h.entry.text for h in memory.retrieve("gate", k=5)] == ["alpha line about the gate"]
    reopened = _memory(tmp_path / "p")
    assert [h.entry.text for h in reopened.retrieve("gate", k=5)] == ["alpha line about the gate"]


def test_canon_propagates_at_its_rate_and_the_stack_assembles_within_budgets(tmp_path: Path) -> None:
    from nimmer_train.memory.canon import Canon, add_canon, assemble, propagate, set_districts

    memory = _memory(tmp_path / "p")
    set_districts(memory, [("core", "ring"), ("ring", "wall"), ("wall", "frontier")])
    add_canon(
        memory,
        [
            Canon("w1", "The emperor has fallen ill.", "world", "core", "normal", rate_ticks_per_hop=2),
            Canon("w2", "The east gate is sealed!", "world", "core", "urgent", rate_ticks_per_hop=0),
            Canon("d1", "The frontier well ran dry.", "district", "frontier", "background", ttl_ticks=5),
            Canon("l1", "A juggler performs at the ring market.", "local", "ring", "normal"),
        ],
    )
    memory.write("Marta owes the scavenger three bolts.", "npc", "working", "casual_dialog")
    memory.write("Her hand trembled in the light.", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)

    def stack(district: str, tick: int, mode: Mode = Mode.REALWORLD, budget: int = 50, local: bool = True):
        propagate(memory, tick)
        return assemble(
            memory,
            district,
            "what does Marta owe",
            mode,
            {"world": budget, "district": budget, "primary": budget, "clasp": budget},
            local=local,
        )

    early = stack("frontier", tick=1)
    assert early.items[0] == "The east gate is sealed!"  # urgent: instant everywhere
    assert "The emperor has fallen ill." not in early.items  # 3 hops x 2 ticks: not yet
    assert "The frontier well ran dry." in early.items and early.layers == ("world", "district", "primary")
    late = stack("frontier", tick=6)
    assert (
        "The emperor has fallen ill." in late.items and "The frontier well ran dry." not in late.items
    )  # ttl
    assert "The emperor has fallen ill." in stack("ring", tick=2).items  # one hop away
    assert "A juggler performs at the ring market." not in stack("wall", tick=9).items
    assert "Her hand trembled in the light." not in late.items
    between = stack("frontier", tick=6, mode=Mode.IN_BETWEEN)
    assert between.layers[-1] == "clasp" and "Her hand trembled in the light." in between.items
    remote = stack("frontier", tick=6, mode=Mode.IN_BETWEEN, local=False)  # a prompt leaving the device
    assert "clasp" not in remote.layers and "Her hand trembled in the light." not in remote.items
    tight = stack("frontier", tick=6, budget=5)
    assert tight.items == ("The east gate is sealed!",)  # 5 words a layer: one world line, no 6-word memory
    assert stack("frontier", tick=6) == late  # deterministic


def test_companion_reads_are_audited_and_prunes_logged(tmp_path: Path) -> None:
    from nimmer_train.errors import NimmerError
    from nimmer_train.memory.companion import (
        audited_read,
        decide,
        decision_log,
        open_companion,
        record_session,
    )

    db = open_companion(tmp_path)
    first = record_session(db, "npc:ilse", "companion_session", "talked about the ferry", started_at=1.0)
    record_session(db, "npc:oran", "sex_worker_session", "a paid evening", started_at=2.0)
    with pytest.raises(NimmerError, match="actor and a reason"):
        audited_read(db, "", "curious")
    assert len(audited_read(db, "player", "reviewing my sessions", now=10.0)) == 2
    decide(db, first, "delete", "player", "too personal", now=11.0)
    assert [s.npc for s in audited_read(db, "player", "check", now=12.0)] == ["npc:oran"]
    assert [row[2] for row in decision_log(db)] == ["read", "delete", "read"]
    with pytest.raises(NimmerError, match="no companion session"):
        decide(db, first, "keep", "player", "gone already")


def test_synthetic_players_are_seeded_and_the_cli_inspects_them(tmp_path: Path, capsys) -> None:
    import json

    from nimmer_train.cli import main
    from nimmer_train.memory.synthetic import generate_player

    a = generate_player(tmp_path / "a", EMBED, seed=5, entries=60)
    b = generate_player(tmp_path / "b", EMBED, seed=5, entries=60)
    assert a["primary"] + a["clasp"] == 60 and {k: a[k] for k in ("primary", "clasp", "consent")} == {
        k: b[k] for k in ("primary", "clasp", "consent")
    }
    texts = [[e.text for e in _memory(tmp_path / p).entries()] for p in ("a", "b")]
    assert texts[0] == texts[1] and len({e.split(" (")[0] for e in texts[0]}) > 20
    assert main(["memory", "inspect", str(tmp_path / "a")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (
        report["primary.sqlite"]["entries"] == a["primary"] and report["primary.sqlite"]["integrity"] == "ok"
    )
    assert "not inspectable" in report["clasp"]


def test_memories_below_the_relevance_floor_stay_out_of_the_stack_however_recent(tmp_path: Path) -> None:
    from nimmer_train.memory.canon import assemble

    memory = _memory(tmp_path / "p")
    memory.write("Marta owes the scavenger three bolts.", "npc", "working", "casual_dialog")
    memory.write("The wind keeps knocking the signs down.", "npc", "working", "casual_dialog")
    query, budgets = "what does Marta owe the scavenger", {"primary": 100}
    hits = {h.entry.text: h.relevance for h in memory.retrieve(query, k=8)}
    near, far = hits["Marta owes the scavenger three bolts."], hits["The wind keeps knocking the signs down."]
    assert near > far  # the floor below is set between them
    every = assemble(memory, "core", query, Mode.REALWORLD, budgets)
    assert len(every.items) == 2
    sure = assemble(memory, "core", query, Mode.REALWORLD, budgets, min_relevance=(near + far) / 2)
    assert sure.items == ("Marta owes the scavenger three bolts.",)
    assert assemble(memory, "core", query, Mode.REALWORLD, budgets, min_relevance=near + 1e-6).items == ()
