"""The player memory's lifecycle by the design's rules (issue 26, item 5;
seeds/inference-and-memory-architecture.txt): the clasp store is encrypted at rest with a key the
device holds ("The clasp store and the in-between dimension"), logout's upstream blob holds only
in-progress events ("Dual-table redundancy + sync-on-auth") and a working memory can outlive its
character transformed ("Memory classes and pruning": lose, blur, or transform)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.errors import NimmerError
from nimmer_train.memory.clasp import CLASP_FILE, LEGACY_FILE
from nimmer_train.memory.consent import exclude, get_consent, set_consent
from nimmer_train.memory.db import connect
from nimmer_train.memory.llm_config import KEY_FILE
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from nimmer_train.memory.schema import CLASP_MIGRATIONS
from nimmer_train.memory.sync import login, logout
from tests.helpers.memory import Clock, HashEmbedder, write_old_store

EMBED = HashEmbedder()
ROWS = (
    "SELECT e.event_uid, e.text, v.embedding, e.access_count FROM entries e "
    "JOIN entries_vec v ON v.rowid = e.id ORDER BY e.event_uid"
)
WHISPER = "Quillfeather hid the ferryman's ledger under the ninth stair"


def _memory(folder: Path) -> PlayerMemory:
    return PlayerMemory(folder, EMBED, clock=Clock())


@pytest.fixture
def memory(tmp_path: Path) -> Iterator[PlayerMemory]:
    opened = _memory(tmp_path / "player")
    yield opened
    opened.close()


def _files_holding(folder: Path, *needles: bytes) -> list[str]:
    return sorted(
        p.name for p in folder.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in needles)
    )


def _vector_window(text: str) -> bytes:
    """64 bytes of ``text``'s stored embedding, from its first non-zero component (the hash
    embedder's vectors are sparse: a window of zeros would match any file)."""
    vector = EMBED.embed([text])[0].astype(np.float32)
    start = int(np.flatnonzero(vector)[0]) * 4
    return vector.tobytes()[start : start + 64]


def _clasp_texts(memory: PlayerMemory) -> list[str]:
    return sorted(
        r.entry.text for r in memory.retrieve("x", k=50, mode=Mode.IN_BETWEEN, categories=["clasp"])
    )


# --- the clasp store, sealed at rest -------------------------------------------------------------
def test_the_clasp_store_is_encrypted_at_rest_no_file_holds_its_text_or_embeddings(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    memory = _memory(folder)
    memory.write("A plain realworld line.", "npc", "working", "casual_dialog")
    memory.write(WHISPER, "npc:oran", "working", "clasp", mode=Mode.IN_BETWEEN)
    memory.write(
        "Oran's second secret: the red lantern.", "npc:oran", "working", "clasp", mode=Mode.IN_BETWEEN
    )
    needles = (b"Quillfeather", b"ferryman", _vector_window(WHISPER))
    assert _files_holding(folder, *needles) == []  # after the writes, while the store is open
    plain = _vector_window("A plain realworld line.")  # the scan's positive control: primary is plain
    assert _files_holding(folder, b"plain realworld") and _files_holding(folder, plain)
    assert any("Quillfeather" in t for t in _clasp_texts(memory))  # positive control (and a flush)
    with pytest.raises(NimmerError, match="already open"):  # one opener: it lives in memory
        _memory(folder).retrieve("x", mode=Mode.IN_BETWEEN)
    memory.close()
    assert _files_holding(folder, *needles) == []
    assert not (folder / LEGACY_FILE).exists() and (folder / CLASP_FILE).exists()
    assert (folder / CLASP_FILE).stat().st_mode & 0o077 == 0

    again = _memory(folder)  # the device's key reads it back
    try:
        assert _clasp_texts(again) == sorted([WHISPER, "Oran's second secret: the red lantern."])
        assert [r.entry.text for r in again.retrieve(WHISPER, k=1, mode=Mode.IN_BETWEEN)] == [WHISPER]
        assert all(r.store == "primary" for r in again.retrieve(WHISPER, k=5))  # realworld: never clasp
    finally:
        again.close()


def test_a_clasp_store_under_another_key_or_changed_is_refused_clearly(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    memory = _memory(folder)
    memory.write(WHISPER, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    memory.close()
    sealed = (folder / CLASP_FILE).read_bytes()
    key = (folder / KEY_FILE).read_text()

    (folder / KEY_FILE).write_text(secrets.token_urlsafe(32))  # another device's key
    for _ in range(2):  # a refused open lets the next one in (no lock left behind)
        with pytest.raises(NimmerError, match="cannot be unsealed with this device's key") as refused:
            _memory(folder).retrieve("x", mode=Mode.IN_BETWEEN)
        assert str(folder / CLASP_FILE) in str(refused.value) and "runtime.key" in str(refused.value)
    assert (folder / CLASP_FILE).read_bytes() == sealed  # refused, never overwritten

    (folder / KEY_FILE).write_text(key)
    changed = bytearray(sealed)
    changed[-40] ^= 1  # one bit of the ciphertext
    (folder / CLASP_FILE).write_bytes(bytes(changed))
    with pytest.raises(NimmerError, match="was changed or is corrupt"):
        _memory(folder).retrieve("x", mode=Mode.IN_BETWEEN)
    (folder / CLASP_FILE).write_bytes(b"SQLite format 3\x00" + bytes(100))
    with pytest.raises(NimmerError, match="not a readable sealed clasp store.*move clasp.sealed aside"):
        _memory(folder).retrieve("x", mode=Mode.IN_BETWEEN)


@pytest.mark.parametrize("version", range(1, len(CLASP_MIGRATIONS) + 1))
def test_a_plaintext_clasp_store_migrates_to_the_sealed_one_keeping_every_row(
    tmp_path: Path, version: int
) -> None:
    source, folder = tmp_path / "old", tmp_path / "player"
    source.mkdir()
    folder.mkdir()
    rows = [(f"clasp-{i}", f"{WHISPER}, night {i}", "working", "clasp") for i in range(12)]
    write_old_store(source / LEGACY_FILE, CLASP_MIGRATIONS[:version], rows)
    old = connect(source / LEGACY_FILE)
    with old:  # a commit still in the WAL: the store as a process killed mid-session leaves it
        old.execute("UPDATE entries SET access_count = 7 WHERE event_uid = 'clasp-3'")
    before = old.execute(ROWS).fetchall()
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(source / f"{LEGACY_FILE}{suffix}", folder / f"{LEGACY_FILE}{suffix}")
    old.close()
    assert len(before) == 12 and (7, "clasp-3") in [(r[3], r[0]) for r in before]

    memory = _memory(folder)
    assert memory.has_clasp()
    try:
        db = memory._store("clasp")
        assert db.execute(ROWS).fetchall() == before  # every row, its words, vector and the WAL's commit
        assert db.execute("SELECT count(*) FROM crystals").fetchone()[0] == 12  # the current schema
        for suffix in ("", "-wal", "-shm"):
            assert not (folder / f"{LEGACY_FILE}{suffix}").exists()
        assert _files_holding(folder, b"Quillfeather", _vector_window(rows[0][1])) == []
    finally:
        memory.close()
    again = _memory(folder)
    try:
        assert len(_clasp_texts(again)) == 12
    finally:
        again.close()


def test_a_crash_between_serialize_and_replace_leaves_the_previous_sealed_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "player"
    memory = _memory(folder)
    memory.write("kept: the first whisper", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    previous = (folder / CLASP_FILE).read_bytes()
    real_replace = os.replace

    def crash(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with caplog.at_level(logging.ERROR, logger="nimmer_train.memory.clasp"):  # committed: logged, not raised
        memory.write("lost: the second whisper", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    assert re.search("could not write the sealed clasp store .*last one sealed", caplog.text)
    assert (folder / CLASP_FILE).read_bytes() == previous
    assert sorted(p.name for p in folder.iterdir() if "tmp" in p.name) == []  # no temp file left
    with pytest.raises(NimmerError, match="could not write"):  # the retry at close fails too
        memory.close()
    monkeypatch.setattr(os, "replace", real_replace)
    assert (folder / CLASP_FILE).read_bytes() == previous

    again = _memory(folder)  # the process is gone; the previous sealed store opens
    try:
        assert _clasp_texts(again) == ["kept: the first whisper"]
        monkeypatch.setattr(os, "replace", crash)
        again.write("held in memory", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)  # logged
        monkeypatch.setattr(os, "replace", real_replace)
        again.write("the next commit", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)  # seals both
    finally:
        again.close()
    last = _memory(folder)
    try:
        assert _clasp_texts(last) == ["held in memory", "kept: the first whisper", "the next commit"]
    finally:
        last.close()


# --- logout's upstream blob ------------------------------------------------------------------------
def _blob(memory: PlayerMemory, path: Path) -> dict[str, dict]:
    return {
        json.loads(line)["event_uid"]: json.loads(line)
        for line in logout(memory, path).read_text().splitlines()
    }


def _canon(event_uid: str, text: str, category: str = "casual_dialog") -> dict[str, str]:
    """A Compositor back-write fragment."""
    return {
        "event_uid": event_uid,
        "text": text,
        "speaker": "world",
        "memory_class": "working",
        "data_category": category,
    }


def test_logout_blob_holds_only_in_progress_events_never_excluded_or_canonised(
    memory: PlayerMemory, tmp_path: Path
) -> None:
    exclude(memory, "dream_content")  # excluded throughout
    exclude(memory, "liminal_wallreads")  # lifted after the first logout
    born = memory.write("I was born under the seventh gate.", "self", "birthright", "casual_dialog")
    before = memory.write("The well ran dry at dawn.", "npc", "working", "casual_dialog")
    dream1 = memory.write("I dreamt of the drowned bell.", "self", "working", "dream_content")
    wall = memory.write("A wall-read of the old district.", "npc", "working", "liminal_wallreads")
    memory.write("Someone coughed.", "npc", "volatile", "casual_dialog", session_id="s1")
    memory.write(WHISPER, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    first = _blob(memory, tmp_path / "up1.jsonl")
    assert list(first) == [before.event_uid]

    set_consent(memory, dataclasses.replace(get_consent(memory), excluded_categories=("dream_content",)))
    during = memory.write("The bridge to Vorhall closed, I think.", "npc", "working", "casual_dialog")
    vow = memory.write("I swore never to kneel again.", "self", "cornerstone", "casual_dialog")
    canonised = memory.write("The toll-keeper fell, maybe pushed.", "npc", "working", "casual_dialog")
    dream2 = memory.write("I dreamt of the bell again.", "self", "working", "dream_content")
    canon = [
        _canon(canonised.event_uid, "The toll-keeper was pushed from the bridge by a warden."),
        _canon("canon-gate-fell", "The east gate fell at noon."),
    ]
    assert login(memory, canon) == 1  # one merged by event_uid, one new
    second = _blob(memory, tmp_path / "up2.jsonl")
    assert sorted(second) == sorted([during.event_uid, vow.event_uid])
    for gone in (born, before, dream1, dream2, wall, canonised):  # birthright, earlier, excluded,
        assert gone.event_uid not in second  # lifted-but-older, canonised
    assert "canon-gate-fell" not in second and "Quillfeather" not in json.dumps(second)
    assert _blob(memory, tmp_path / "up3.jsonl") == {}  # nothing new, nothing sent again
    texts = {e.event_uid: e.text for e in memory.entries()}
    assert texts[canonised.event_uid] == canon[0]["text"] and "canon-gate-fell" in texts


def test_a_bad_canon_fragment_changes_nothing(memory: PlayerMemory, tmp_path: Path) -> None:
    mine = memory.write("The bridge closed, I think.", "npc", "working", "casual_dialog")
    bad = _canon(mine.event_uid, "x", "no_such_category")
    with pytest.raises(NimmerError, match="data_category"):
        login(memory, [bad])
    assert [e.text for e in memory.entries()] == [mine.text]  # the local perspective is not lost
    assert [r.entry.text for r in memory.retrieve("bridge closed", k=3)] == [mine.text]
    assert list(_blob(memory, tmp_path / "up.jsonl")) == [mine.event_uid]  # still in progress


# --- death: the transform rule ---------------------------------------------------------------------
def test_death_transforms_working_memories_into_half_remembered_dreams(
    memory: PlayerMemory, tmp_path: Path
) -> None:
    born = memory.write("My mother's name was Ysolde.", "self", "birthright", "casual_dialog")
    core = memory.write("I swore never to kneel.", "self", "cornerstone", "casual_dialog")
    work = memory.write(
        "The bridge to Vorhall closed at dusk yesterday.",
        "npc:warden",
        "working",
        "casual_dialog",
        semantic_type="fact",
        importance=0.8,
        emotional_valence=-0.6,
        trait_engagement={"Aletheia": 1.0, "Sophrosyne": -0.5},
        source_ids=("canon-bridge",),
        session_id="s1",
    )
    long = memory.write("w" * memory.max_chars, "npc", "working", "liminal_wallreads")
    memory.write("Someone coughed.", "npc", "volatile", "casual_dialog", session_id="s1")
    memory.write(WHISPER, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)

    outcome = memory.character_death(working="transform")
    assert outcome["transformed"] == sorted([work.event_uid, long.event_uid])
    assert outcome["blurred"] == [] and len(outcome["lost"]) == 1  # the volatile one
    assert outcome["kept"] == sorted([born.event_uid, core.event_uid])
    by_uid = {e.event_uid: e for e in memory.entries()}
    assert len(by_uid) == 4
    dream = by_uid[work.event_uid]
    assert (
        dream.text
        == 'A half-remembered dream: someone said, "The bridge to Vorhall closed at dusk yesterday."'
    )
    assert (dream.speaker, dream.semantic_type) == ("dream", "episode")  # re-attributed, no longer a fact
    assert dream.importance == pytest.approx(0.4) and dream.emotional_valence == pytest.approx(-0.3)
    assert dream.trait_engagement == work.trait_engagement and dream.data_category == "casual_dialog"
    assert (dream.source_ids, dream.session_id) == (("canon-bridge",), "s1")  # provenance kept
    assert len(by_uid[long.event_uid].text) == memory.max_chars  # framed, cut to fit
    assert by_uid[long.event_uid].data_category == "liminal_wallreads"  # never another category
    assert by_uid[born.event_uid].text == born.text and by_uid[core.event_uid].text == core.text
    hits = memory.retrieve("bridge to Vorhall closed", k=1)
    assert hits[0].entry.event_uid == work.event_uid  # re-embedded: found by its words
    assert _clasp_texts(memory) == []  # the clasp was cleared


def test_a_death_that_fails_midway_changes_nothing(memory: PlayerMemory, tmp_path: Path) -> None:
    memory.write("The bridge closed at dusk.", "npc", "working", "casual_dialog")
    memory.write("Someone coughed.", "npc", "volatile", "casual_dialog", session_id="s1")
    memory.write(WHISPER, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    before = [(e.event_uid, e.text) for e in memory.entries()]

    class Broken(HashEmbedder):
        def embed(self, texts: list[str]) -> np.ndarray:
            raise RuntimeError("embedding model crashed")

    memory.embedder = Broken()
    with pytest.raises(RuntimeError, match="crashed"):
        memory.character_death(working="transform")
    assert [(e.event_uid, e.text) for e in memory.entries()] == before
    memory.embedder = EMBED
    assert [r.entry.text for r in memory.retrieve("bridge closed", k=1)] == ["The bridge closed at dusk."]
    assert _clasp_texts(memory) == [WHISPER]  # not cleared either: the death did not happen
