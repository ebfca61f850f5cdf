"""The player stores follow the design's rules (issue 26; seeds/inference-and-memory-architecture.txt):
the player's LLM configuration stored on the device with BYOK keys sealed ("Schema sketch (player
LLM configuration + cloud LoRA backup)"); the consent record carries the design's
player_data_sharing_consent columns ("Schema sketch (data-sharing consent + base-model
versioning)"), updated after each round or upload; migrations from today's stores keep every row."""

from __future__ import annotations

import io
import json
from pathlib import Path

import apsw
import pytest

from nimmer_train.cli import main
from nimmer_train.errors import ConfigError, NimmerError
from nimmer_train.memory.consent import (
    a2_upload,
    exclude,
    get_consent,
    grant,
    note_device_contribution,
    revoke,
    write_profile,
)
from nimmer_train.memory.db import connect
from nimmer_train.memory.llm_config import CONFIG_FILE, KEY_FILE, runtime_row, set_config
from nimmer_train.memory.player_memory import PRIMARY_FILE, Mode, PlayerMemory
from nimmer_train.memory.schema import PRIMARY_MIGRATIONS
from nimmer_train.memory.sync import login, logout
from nimmer_train.runtime.rings import player_rings
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.llm_server import serve
from tests.helpers.memory import HashEmbedder, write_v3_store


def _rows(path: Path, table: str) -> list[tuple]:
    db = connect(path)
    try:
        return list(db.execute(f"SELECT * FROM {table} ORDER BY 1"))
    finally:
        db.close()


def test_the_consent_record_has_the_designs_columns_updated_after_each_round_or_upload(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "player"
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        assert get_consent(memory).contribution_count == 0 and get_consent(memory).benefit_tier is None
        write_profile(folder, "player-7731", "Ilsa")
        memory.write("The well ran dry at dawn.", "npc", "working", "casual_dialog")
        granted = grant(memory, "A2_anonymized", now=100.0)
        assert granted.anonymization_method == "identifier_scrub_dp_sgd"
        assert get_consent(memory).benefit_tier == "larger_discount_faster_updates_training_priorities"
        assert get_consent(memory).can_request_deletion is True
        assert a2_upload(memory, "player-7731", "Ilsa") is not None
        after_upload = get_consent(memory)
        assert after_upload.contribution_count == 1 and after_upload.last_contribution_at is not None
        assert a2_upload(memory, "player-7731", "Ilsa") is None  # nothing new: nothing counted
        assert get_consent(memory).contribution_count == 1
    finally:
        memory.close()
    # an A.1 round: the federated client holds the device folder
    after_round = note_device_contribution(folder, now=200.0)
    assert (after_round.contribution_count, after_round.last_contribution_at) == (2, 200.0)
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        revoked = revoke(memory, now=300.0)  # revocation keeps the history of contributions
        assert (revoked.contribution_count, revoked.revoked_at) == (2, 300.0)
        regranted = grant(memory, "A1_federated", now=400.0)
        assert regranted.contribution_count == 2 and regranted.revoked_at is None
        assert regranted.anonymization_method == "federated_dp_updates_only"
    finally:
        memory.close()


def test_migrating_todays_store_to_the_consent_columns_keeps_every_row(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    folder.mkdir()
    rows = [(f"uid-{i}", f"memory line {i}", "working", "casual_dialog") for i in range(5)]
    write_v3_store(folder, rows)
    path = folder / PRIMARY_FILE
    db = connect(path)
    with db:  # today's consent row (six columns), a contributor id and a sent upload
        db.execute(
            "INSERT INTO player_data_sharing_consent VALUES "
            "(1, 'A2_anonymized', '[\"casual_dialog\"]', '[]', 5.0, NULL)"
        )
        db.execute("INSERT INTO contributor VALUES (1, 'c-1', 6.0)")
        db.execute("INSERT INTO a2_uploads VALUES ('up-1', 7.0, NULL)")
    db.close()
    before = {
        t: _rows(path, t) for t in ("entries", "contributor", "a2_uploads", "player_data_sharing_consent")
    }
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        assert memory.primary.execute("PRAGMA user_version").fetchone()[0] == len(PRIMARY_MIGRATIONS)
        record = get_consent(memory)
        assert (record.sharing_tier, record.data_categories_shared, record.granted_at) == (
            "A2_anonymized",
            ("casual_dialog",),
            5.0,
        )
        assert (record.contribution_count, record.can_request_deletion, record.benefit_tier) == (
            0,
            True,
            None,
        )
    finally:
        memory.close()
    for table in ("entries", "contributor", "a2_uploads"):
        assert _rows(path, table) == before[table]
    consent = _rows(path, "player_data_sharing_consent")
    assert consent[0][:6] == before["player_data_sharing_consent"][0]  # old columns unchanged


# --- player_llm_config + BYOK sealed (design: "Schema sketch (player LLM configuration ...)") ---
KEY = "sk-PLANTED-byok-7f3a9c"


def test_a_byok_key_is_never_on_disk_in_clear_and_only_the_runtime_reads_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "player"
    with serve(lambda body: json.dumps({"utterance": "Noted."})) as server:
        monkeypatch.setattr("sys.stdin", io.StringIO(KEY + "\n"))
        argv = ["llm-config", "set", str(folder), "--player-id", "p-1", "--casual-ring", "C_external"]
        argv += ["--casual-provider", "openai", "--casual-endpoint", f"{server.url}/v1"]
        assert main([*argv, "--casual-model", "gpt-x", "--key-stdin", "casual"]) == 0
        assert main(["llm-config", "show", str(folder)]) == 0
        shown = json.loads(capsys.readouterr().out.split("\n}\n", 1)[1])
        assert shown["casual_tier_credentials_ref"] and KEY not in json.dumps(shown)
        assert "top_k_unsupported_dropped" in shown["feature_compat_warnings"]["casual_tier"]
        for path in folder.rglob("*"):  # every byte the device holds: the store, its WAL, the key file
            if path.is_file():
                assert KEY.encode() not in path.read_bytes(), path
        assert (folder / KEY_FILE).stat().st_mode & 0o077 == 0
        row, keys = runtime_row(folder)
        assert keys == {"casual": KEY}
        rings, _ = player_rings(row, keys=keys)
        NpcRuntime(load_catalogue(), rings).speak(
            TurnRequest("npc", {"Sophrosyne": 0.8}, "Hello.", "answer", "the gate")
        )
    assert server.headers[-1]["Authorization"] == f"Bearer {KEY}"  # no environment variable involved


def test_the_stored_llm_config_keeps_the_designs_tier_rules(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    with pytest.raises(ConfigError, match="deep_tier_ring.*not allowed"):
        set_config(folder, "p-1", casual_tier_ring="B_our_farm", deep_tier_ring="A_local")
    with pytest.raises(ConfigError, match="hivemind_tier_provider"):
        set_config(folder, "p-1", casual_tier_ring="B_our_farm", hivemind_tier_provider="openai")
    with pytest.raises(ConfigError, match="unknown provider"):
        set_config(
            folder, "p-1", casual_tier_ring="C_external", casual_tier_provider="x", casual_tier_model="m"
        )
    row = set_config(folder, "p-1", casual_tier_ring="A_local", deep_tier_ring="B_our_farm")
    assert row["hivemind_tier_provider"] == "anthropic_via_us" and row["configured_at"] is not None
    again = set_config(
        folder, "p-1", deep_tier_ring="C_external", deep_tier_provider="together", deep_tier_model="m"
    )
    assert again["casual_tier_ring"] == "A_local" and again["configured_at"] == row["configured_at"]
    assert again["feature_compat_warnings"] == {"casual_tier": [], "deep_tier": []}  # together takes all
    assert _rows(folder / CONFIG_FILE, "player_llm_config")[0][0] == "p-1"
    db = connect(folder / CONFIG_FILE)
    assert db.execute("PRAGMA user_version").fetchone()[0] == 1
    db.close()


# --- memory classes (design: "Memory classes and pruning", "The clasp store and the in-between") ---
def test_birthright_memories_are_locked_at_creation_no_edit_no_prune(tmp_path: Path) -> None:
    memory = PlayerMemory(tmp_path / "player", HashEmbedder())
    try:
        born = memory.write("I was born under the seventh gate.", "self", "birthright", "casual_dialog")
        uid = born.event_uid
        for sql in (
            "UPDATE entries SET text = 'rewritten' WHERE event_uid = ?",
            "UPDATE entries SET memory_class = 'working' WHERE event_uid = ?",
        ):
            with pytest.raises(apsw.ConstraintError, match="locked at character creation"):
                memory.primary.execute(sql, (uid,))
        with pytest.raises(apsw.ConstraintError, match="no prune"):
            memory.delete([uid])
        working = memory.write("A passing remark.", "npc", "working", "casual_dialog")
        with pytest.raises(apsw.ConstraintError, match="no edit"):  # nor is anything promoted into it
            memory.primary.execute(
                "UPDATE entries SET memory_class = 'birthright' WHERE event_uid = ?", (working.event_uid,)
            )
        memory.primary.execute("UPDATE entries SET access_count = 3 WHERE event_uid = ?", (uid,))
        assert [e.text for e in memory.entries() if e.event_uid == uid] == [born.text]
    finally:
        memory.close()


def test_death_clears_the_clasp_blurs_working_and_keeps_birthright_and_cornerstone(tmp_path: Path) -> None:
    memory = PlayerMemory(tmp_path / "player", HashEmbedder())
    try:
        born = memory.write("My mother's name was Ysolde.", "self", "birthright", "casual_dialog")
        core = memory.write("I swore never to kneel.", "self", "cornerstone", "casual_dialog")
        work = memory.write(
            "The bridge to Vorhall closed at dusk yesterday.",
            "npc",
            "working",
            "casual_dialog",
            importance=0.8,
        )
        memory.write("Someone coughed.", "npc", "volatile", "casual_dialog", session_id="s1")
        memory.write("The ribbon in my boot.", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
        memory.primary.execute("UPDATE entries SET access_count = 4 WHERE event_uid = ?", (born.event_uid,))
        before = memory.retrieve("ribbon boot", mode=Mode.IN_BETWEEN, k=5)
        assert any("ribbon" in r.entry.text for r in before)  # the positive control
        outcome = memory.character_death(working="blur")
        by_uid = {e.event_uid: e for e in memory.entries()}
        assert sorted(outcome["kept"]) == sorted([born.event_uid, core.event_uid])
        assert by_uid[born.event_uid].text == born.text and by_uid[core.event_uid].text == core.text
        assert outcome["blurred"] == [work.event_uid] and len(outcome["lost"]) == 1  # the volatile one
        blurred = by_uid[work.event_uid]
        assert blurred.text == "The bridge to Vorhall ..." and blurred.importance == pytest.approx(0.4)
        assert len(by_uid) == 3
        clasp = memory.retrieve("ribbon boot", mode=Mode.IN_BETWEEN, k=5)
        assert all("ribbon" not in r.entry.text for r in clasp)  # the clasp was cleared
        assert memory._store("clasp").execute("SELECT count(*) FROM entries").fetchone()[0] == 0
        restored = memory.respawn()
        assert [(e.event_uid, e.text, e.access_count) for e in restored] == [(born.event_uid, born.text, 0)]
        with pytest.raises(NimmerError, match="death rule"):
            memory.character_death(working="forget-everything")
    finally:
        memory.close()


# --- sync on auth (design: "Dual-table redundancy + sync-on-auth") ---
def test_logout_never_sends_excluded_categories_and_login_merges_canon_by_event_uid(tmp_path: Path) -> None:
    memory = PlayerMemory(tmp_path / "player", HashEmbedder())
    try:
        mine = memory.write("The bridge closed, I think.", "npc", "working", "casual_dialog")
        memory.write("A wall-read of the old district.", "npc", "working", "liminal_wallreads")
        exclude(memory, "liminal_wallreads")
        blob = logout(memory, tmp_path / "upstream.jsonl").read_text()
        assert "wall-read" not in blob and "bridge closed" in blob
        canon = {
            "event_uid": mine.event_uid,
            "text": "The bridge to Vorhall closed at dusk.",
            "speaker": "world",
            "memory_class": "working",
            "data_category": "casual_dialog",
        }
        assert login(memory, [canon]) == 0  # merged, not new
        texts = {e.event_uid: e.text for e in memory.entries()}
        assert texts[mine.event_uid] == canon["text"] and len(texts) == 2
        assert login(memory, [canon]) == 0 and len(memory.entries()) == 2
    finally:
        memory.close()
