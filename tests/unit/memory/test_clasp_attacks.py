"""Adversarial review of the sealed clasp store (issue 26 item 5: ``memory/clasp.py``) and of
logout's upstream blob (``memory/sync.py``), run for real: real files, real AES-GCM and HKDF,
real flocks, SQLite's own VFS layer.

The first section holds one test per defect the review confirmed, now fixed and kept as
regression tests; one known limit stays ``xfail(strict=True)``, its reason saying what goes
wrong. The other tests pin properties that held under attack from the start."""

from __future__ import annotations

import base64
import errno
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import apsw
import pytest

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.consolidation import consolidate
from nimmer_train.agent.ingestion import Exchange, TranscriptIndexer
from nimmer_train.agent.scheduler import run_once
from nimmer_train.agent.tools import memory_tools
from nimmer_train.errors import NimmerError
from nimmer_train.memory import clasp, sync
from nimmer_train.memory.clasp import CLASP_FILE, LEGACY_FILE, MAGIC, open_clasp
from nimmer_train.memory.consent import exclude
from nimmer_train.memory.db import connect
from nimmer_train.memory.llm_config import KEY_FILE, device_secret
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from nimmer_train.memory.schema import CLASP_MIGRATIONS
from nimmer_train.memory.sync import FALLBACK_FILE, logout
from tests.helpers.memory import Clock, HashEmbedder, write_old_store

EMBED = HashEmbedder()
REPO = Path(__file__).resolve().parents[3]
SECRET = "Quillfeather hid the ferryman's ledger under the ninth stair"


def _memory(folder: Path) -> PlayerMemory:
    return PlayerMemory(folder, EMBED, clock=Clock())


def _with_secret(folder: Path) -> PlayerMemory:
    """A player whose clasp holds :data:`SECRET` (open: it holds the clasp lock)."""
    memory = _memory(folder)
    memory.write(SECRET, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    return memory


def _agent(folder: Path) -> AgentMemory:
    return AgentMemory(folder, EMBED, clock=Clock())


def _image(folder: Path) -> bytes:
    """The SQLite image sealed in the folder's clasp.sealed, opened with the device's key."""
    image, _, _ = clasp._unseal_file(folder / CLASP_FILE, device_secret(folder), folder / KEY_FILE)
    return image


def _header(blob: bytes) -> tuple[bytes, bytes]:
    """(the authenticated header line, the ciphertext) of a sealed file."""
    end = blob.index(b"\n", len(MAGIC))
    return blob[: end + 1], blob[end + 1 :]


def _clasp_texts(memory: PlayerMemory) -> list[str]:
    hits = memory.retrieve("x", k=50, mode=Mode.IN_BETWEEN, categories=["clasp"])
    return sorted(r.entry.text for r in hits)


def _legacy_with_wal(folder: Path, tmp_path: Path, deleted: str, in_wal: str) -> None:
    """A plaintext clasp.sqlite as the code before issue 26 left it: entries ``deleted`` by its
    clear_clasp (DELETE, no secure_delete) and a last commit ``in_wal`` still in the -wal."""
    source = tmp_path / "old"
    source.mkdir()
    rows = [(f"keep-{i}", f"kept whisper {i}", "working", "clasp") for i in range(3)]
    rows += [(f"gone-{i}", f"{deleted} {i} " * 8, "working", "clasp") for i in range(4)]
    write_old_store(source / LEGACY_FILE, CLASP_MIGRATIONS, rows)
    old = connect(source / LEGACY_FILE)
    with old:  # the old clear_clasp / a consolidation purge: plain DELETEs
        old.execute(
            "DELETE FROM entries_vec WHERE rowid IN (SELECT id FROM entries WHERE event_uid LIKE 'gone-%')"
        )
        old.execute("DELETE FROM entries WHERE event_uid LIKE 'gone-%'")
    with old:  # a process killed mid-session leaves its last commit in the WAL
        old.execute("UPDATE entries SET text = ? WHERE event_uid = 'keep-0'", (in_wal,))
    folder.mkdir(parents=True)
    for suffix in ("", "-wal", "-shm"):
        shutil.copy(source / f"{LEGACY_FILE}{suffix}", folder / f"{LEGACY_FILE}{suffix}")
    old.close()


# --- confirmed defects (fixed) --------------------------------------------------------------------------
def test_migration_overwrites_the_legacy_wal_before_it_goes(tmp_path: Path) -> None:
    folder, evidence = tmp_path / "player", tmp_path / "evidence"
    _legacy_with_wal(folder, tmp_path, "Gonedeadword", "Walonlysecret of the lighthouse")
    evidence.mkdir()
    assert b"Walonlysecret" in (folder / f"{LEGACY_FILE}-wal").read_bytes()
    # a second name on the same inodes shows what happens to their blocks (unlink frees them as they are)
    os.link(folder / LEGACY_FILE, evidence / "main")
    os.link(folder / f"{LEGACY_FILE}-wal", evidence / "wal")
    memory = _memory(folder)
    try:
        assert "Walonlysecret of the lighthouse" in _clasp_texts(memory)  # migrated
    finally:
        memory.close()
    assert set((evidence / "main").read_bytes()) <= {0}  # control: the main file was zeroed
    assert b"Walonlysecret" not in (evidence / "wal").read_bytes()


def test_migration_does_not_carry_deleted_legacy_rows_into_the_sealed_image(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    _legacy_with_wal(folder, tmp_path, "Gonedeadword", "the last whisper")
    assert (
        b"Gonedeadword" in (folder / LEGACY_FILE).read_bytes() + (folder / f"{LEGACY_FILE}-wal").read_bytes()
    )
    memory = _memory(folder)
    try:
        assert not any("Gonedeadword" in t for t in _clasp_texts(memory))  # deleted rows stay deleted
    finally:
        memory.close()
    assert b"kept whisper" in _image(folder)  # control: the image is the store
    assert b"Gonedeadword" not in _image(folder)
    assert b"gonedeadword" not in _image(folder)  # nor a term of its full-text index


def test_a_death_that_cannot_reach_the_clasp_changes_nothing(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    holder = _with_secret(folder)  # e.g. the runtime's PlayerMemory, or the indexer's AgentMemory
    holder.write("one two three four five six seven eight", "npc", "working", "casual_dialog")
    holder.write("Someone coughed.", "npc", "volatile", "casual_dialog", session_id="s1")
    dying = _memory(folder)
    try:
        before = [(e.text, e.importance) for e in dying.entries()]
        with pytest.raises(NimmerError, match="already open"):
            dying.character_death("blur")
        holder.close()
        assert [(e.text, e.importance) for e in dying.entries()] == before
    finally:
        dying.close()


def test_on_demand_consolidation_beside_a_server_holding_the_clasp_skips_or_completes(tmp_path: Path) -> None:
    folder = tmp_path / "agent"
    server = _agent(folder)
    server.working_memory_note("a note between us", mode=Mode.IN_BETWEEN)  # the server holds the clasp
    server.working_memory_note("a realworld note")
    cli = _agent(folder)
    try:
        report = run_once(cli)  # None (skipped) or a whole report: never a half run
        assert report is None or "wall_s" in report
    finally:
        cli.close()
        server.close()


def test_an_in_between_exchange_is_not_lost_while_another_opener_holds_the_clasp(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    runtime_memory = _memory(folder)
    runtime_memory.write("The NPC's in-between line.", "npc:oran", "working", "clasp", mode=Mode.IN_BETWEEN)
    agent = _agent(folder)
    indexer = TranscriptIndexer(agent, tries=3, backoff_s=0.05)
    said = "I never told anyone about the lighthouse"
    indexer.submit(Exchange("s1", ("oran-clasp-t1",), (("player", said),), 1.0, Mode.IN_BETWEEN))
    indexer.flush(timeout=10)
    runtime_memory.close()  # the other opener lets go
    indexer.close()
    try:
        texts = [c.text for c in agent.crystals("clasp")]
        assert indexer.dropped == [] and any(said in t for t in texts)
    finally:
        agent.close()


def _fail_next_flushes(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    """The next ``count`` sealed writes fail as a full disk does (ENOSPC); then writes work."""
    real, left = clasp.write_bytes_atomic, [count]

    def flaky(*args: object, **kwargs: object) -> None:
        if left[0]:
            left[0] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(clasp, "write_bytes_atomic", flaky)


def test_a_failed_flush_and_the_indexers_retry_store_each_exchange_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    agent = _agent(tmp_path / "agent")
    agent.working_memory_note("first", mode=Mode.IN_BETWEEN)
    indexer = TranscriptIndexer(agent)
    try:
        _fail_next_flushes(monkeypatch, 1)
        batch = [
            Exchange("s1", (f"t{i}",), (("player", f"Lighthouse confession {i}"),), 1.0, Mode.IN_BETWEEN)
            for i in range(2)
        ]
        indexer._index(batch)  # one batch, as the indexer's thread takes it (then one at a time)
        texts = [c.text for c in agent.crystals("clasp")]
        assert sorted(t for t in texts if "confession" in t) == [
            "player: Lighthouse confession 0",
            "player: Lighthouse confession 1",
        ]
    finally:
        indexer.close()
        agent.close()


def test_a_note_kept_after_a_failed_flush_is_searchable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "agent"
    agent = _agent(folder)
    try:
        agent.working_memory_note("first thing", mode=Mode.IN_BETWEEN)
        _fail_next_flushes(monkeypatch, 1)
        with caplog.at_level(logging.ERROR, logger="nimmer_train.memory.clasp"):
            agent.working_memory_note("Marigold secret of the tower", mode=Mode.IN_BETWEEN)  # committed
        assert f"{folder / CLASP_FILE}: [Errno 28]" in caplog.text and "kept in memory" in caplog.text
        kept = "Marigold secret of the tower" in [c.text for c in agent.crystals("clasp")]
        found = [r["text"] for r in agent.memory_search("Marigold secret of the tower", mode=Mode.IN_BETWEEN)]
        assert kept and "Marigold secret of the tower" in found
    finally:
        agent.close()


def test_realworld_memory_status_does_not_reveal_the_clasp(tmp_path: Path) -> None:
    agent = _agent(tmp_path / "agent")
    try:
        agent.working_memory_note("a realworld note")
        agent.working_memory_note(SECRET, mode=Mode.IN_BETWEEN)
        consolidate(agent)
        status = json.dumps(memory_tools(agent, Mode.REALWORLD).call("memory_status", {}), default=str)
        assert "Quillfeather" not in status  # the words never show (holds)
        assert "clasp" not in status
    finally:
        agent.close()


def test_a_second_logout_before_the_push_keeps_the_first_sessions_events(tmp_path: Path) -> None:
    memory = _memory(tmp_path / "player")
    upstream = tmp_path / "upstream.jsonl"
    try:
        first = memory.write("The well ran dry at dawn.", "npc", "working", "casual_dialog")
        logout(memory, upstream)  # the push fails (offline); the file stays for later
        second = memory.write("The bridge closed at dusk.", "npc", "working", "casual_dialog")
        logout(memory, upstream)
        uids = [json.loads(line)["event_uid"] for line in upstream.read_text().splitlines()]
        assert second.event_uid in uids
        assert first.event_uid in uids
    finally:
        memory.close()


@pytest.mark.xfail(
    strict=True,
    reason="rollback is not detected (low severity: whoever can swap the file can usually read "
    "runtime.key too): a clasp.sealed from before a death, put back (a file-level backup, a sync "
    "tool), opens silently and its cleared entries live again",
)
def test_an_older_sealed_file_put_back_after_a_death_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    memory = _with_secret(folder)
    before_death = (folder / CLASP_FILE).read_bytes()
    memory.character_death()
    assert _clasp_texts(memory) == []
    memory.close()
    (folder / CLASP_FILE).write_bytes(before_death)
    again = _memory(folder)
    try:
        with pytest.raises(NimmerError):
            _clasp_texts(again)
    finally:
        again.close()


def test_plaintext_rows_written_after_the_migration_are_not_destroyed(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    _with_secret(folder).close()
    write_old_store(  # an older build, which knows only clasp.sqlite, ran in between
        folder / LEGACY_FILE, CLASP_MIGRATIONS, [("later", "said under the older build", "working", "clasp")]
    )
    sealed = (folder / CLASP_FILE).read_bytes()
    again = _memory(folder)
    try:  # refused, naming both files and what to do; neither store loses a row
        with pytest.raises(NimmerError, match=f"{LEGACY_FILE} .*1 of them not in {CLASP_FILE}.*Move"):
            _clasp_texts(again)
        assert b"said under the older build" in (folder / LEGACY_FILE).read_bytes()  # WAL folded in
        assert (folder / CLASP_FILE).read_bytes() == sealed
        (folder / LEGACY_FILE).rename(tmp_path / "kept-aside.sqlite")  # the error's first way out
        assert _clasp_texts(again) == [SECRET]
    finally:
        again.close()


# --- properties that hold -------------------------------------------------------------------------
class _SpyVFS(apsw.VFS):
    """The default VFS, recording every file SQLite opens (temp files have no name)."""

    def __init__(self) -> None:
        self.opened: list[object] = []
        super().__init__("clasp-attack-spy", base="", makedefault=True)

    def xOpen(self, name: object, flags: list[int]) -> apsw.VFSFile:  # noqa: N802 - apsw's name
        self.opened.append(name.filename() if isinstance(name, apsw.URIFilename) else name)
        return super().xOpen(name, flags)


def _spill(db: apsw.Connection) -> None:
    """Work that spills to temp files when SQLite may: a tiny cache, a big temp table and sort."""
    db.execute("DROP TABLE IF EXISTS temp.t")
    db.execute("PRAGMA cache_size=5")
    db.execute("PRAGMA temp.cache_size=5")
    with db:
        db.execute("CREATE TABLE spill(x)")
        db.executemany("INSERT INTO spill VALUES (?)", [(f"{SECRET} {i}" * 4,) for i in range(3000)])
    db.execute("CREATE TEMP TABLE t AS SELECT * FROM spill")
    assert len(list(db.execute("SELECT x FROM spill ORDER BY x DESC"))) == 3000
    with db:
        db.execute("UPDATE spill SET x = x || 'y'")  # a big transaction: its journal stays in memory


def test_the_open_clasp_store_never_opens_a_file_even_when_work_spills(tmp_path: Path) -> None:
    spy = _SpyVFS()
    try:
        control = connect(Path(":memory:"))  # positive control: temp_store=FILE spills through the spy
        control.execute("PRAGMA temp_store=FILE")
        _spill(control)
        control.close()
        assert None in spy.opened
        spy.opened.clear()
        store = open_clasp(tmp_path / "player")
        try:
            _spill(store)
            assert store.execute("PRAGMA journal_mode").fetchone()[0] == "memory"
            store.reset()  # a death: deserialize must keep the store hardened
            assert store.execute("PRAGMA secure_delete").fetchone()[0] == 1
            assert store.execute("PRAGMA temp_store").fetchone()[0] == 2
            _spill(store)
        finally:
            store.close()
        assert spy.opened == []
    finally:
        spy.unregister()
    folder = tmp_path / "player"
    assert sorted(p.name for p in folder.iterdir()) == ["clasp.lock", CLASP_FILE, KEY_FILE]
    assert not any(b"Quillfeather" in p.read_bytes() for p in folder.iterdir())


def test_every_flush_takes_a_fresh_nonce_and_no_header_or_file_swap_opens(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    memory = _memory(a)
    sealed = []
    for i in range(5):
        memory.write(f"{SECRET} {i}", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
        sealed.append((a / CLASP_FILE).read_bytes())
    memory.close()
    headers = [json.loads(_header(s)[0][len(MAGIC) :]) for s in sealed]
    nonces = [base64.b64decode(h["nonce"]) for h in headers]
    assert len(set(nonces)) == 5 and all(len(n) == 12 for n in nonces)
    assert len({json.dumps(h["key"], sort_keys=True) for h in headers}) == 1  # one store key, wrapped once

    b.mkdir()
    shutil.copy(a / KEY_FILE, b / KEY_FILE)  # the same device key: only the AAD tells the stores apart
    other = _memory(b)
    other.write("another store's line", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    other.close()
    foreign = (b / CLASP_FILE).read_bytes()
    for forged in (
        _header(sealed[0])[0] + _header(sealed[4])[1],  # an older header (nonce) on newer ciphertext
        _header(foreign)[0] + _header(sealed[4])[1],  # another store's header (key) on this ciphertext
        _header(sealed[4])[0] + _header(sealed[4])[1][:-1],  # truncated by one byte
    ):
        (a / CLASP_FILE).write_bytes(forged)
        with pytest.raises(NimmerError, match="changed or is corrupt|cannot be unsealed"):
            open_clasp(a)
        assert (a / CLASP_FILE).read_bytes() == forged  # refused, never overwritten

    (b / KEY_FILE).write_text("another-device-" + "k" * 40)
    (b / CLASP_FILE).write_bytes(sealed[4])  # a whole file moved to a player of another device
    with pytest.raises(NimmerError, match="cannot be unsealed with this device's key"):
        open_clasp(b)


def test_realworld_work_never_opens_the_clasp_nor_carries_its_words(tmp_path: Path) -> None:
    folder, upstream = tmp_path / "player", tmp_path / "upstream.jsonl"
    holder = _with_secret(folder)  # holds the clasp: anything that opened it would fail loudly
    holder.write("The ferryman sleeps at noon.", "npc", "working", "casual_dialog")
    agent = _agent(folder)
    try:
        agent.working_memory_note("The ferryman's ledger is a rumour.")
        hits = agent.memory_search("ferryman ledger ninth stair", mode=Mode.REALWORLD)
        status = agent.memory_status(Mode.REALWORLD)
        found = agent.memory.retrieve("Quillfeather ferryman ledger", k=10, mode=Mode.REALWORLD)
        logout(agent.memory, upstream)
        out = json.dumps([hits, status, [r.entry.text for r in found]], default=str)
        assert "ferryman" in out and "Quillfeather" not in out
        assert all(r.store == "primary" for r in found)
        assert b"Quillfeather" not in upstream.read_bytes()
        assert b"ferryman" in (folder / FALLBACK_FILE).read_bytes()  # control: the snapshot is plain
        assert not any(b"Quillfeather" in p.read_bytes() for p in folder.rglob("*") if p.is_file())
    finally:
        agent.close()
        holder.close()


def test_logout_resends_after_a_crash_and_never_sends_clasp_birthright_volatile_or_excluded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    memory = _memory(tmp_path / "player")
    try:
        exclude(memory, "dream_content")
        sent = memory.write("The well ran dry at dawn.", "npc", "working", "casual_dialog")
        vow = memory.write("I swore never to kneel.", "self", "cornerstone", "casual_dialog")
        memory.write("I was born under the seventh gate.", "self", "birthright", "casual_dialog")
        memory.write("Someone coughed.", "npc", "volatile", "casual_dialog", session_id="s1")
        memory.write("I dreamt of the drowned bell.", "self", "working", "dream_content")
        memory.write(SECRET, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
        real = sync.write_bytes_atomic

        def killed_after_the_blob(path: Path, data: bytes, private: bool = False) -> None:
            real(path, data, private)
            raise KeyboardInterrupt("killed after the blob, before the marks")

        monkeypatch.setattr(sync, "write_bytes_atomic", killed_after_the_blob)
        with pytest.raises(KeyboardInterrupt):
            logout(memory, tmp_path / "up1.jsonl")
        monkeypatch.setattr(sync, "write_bytes_atomic", real)
        blob = logout(memory, tmp_path / "up2.jsonl").read_text()
        uids = sorted(json.loads(line)["event_uid"] for line in blob.splitlines())
        assert uids == sorted([sent.event_uid, vow.event_uid])  # resent, nothing else
        assert "Quillfeather" not in blob and "embedding" not in blob
        assert logout(memory, tmp_path / "up3.jsonl").read_text() == ""
    finally:
        memory.close()


_KILLED_OPEN = """
import os
from pathlib import Path
from nimmer_train.memory import clasp
setattr(clasp, {step!r}, lambda *args, **kwargs: os._exit(137))  # the process dies right there
clasp.open_clasp(Path({folder!r}))
"""


def _open_killed_at(folder: Path, step: str) -> None:
    """open_clasp in a child process that is killed (exit 137) when it reaches ``step``."""
    code = _KILLED_OPEN.format(step=step, folder=str(folder))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, timeout=120)
    assert done.returncode == 137, done.stderr.decode()[-2000:]


def test_a_migration_killed_before_or_after_its_flush_loses_no_row_and_leaves_no_plaintext(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "player"
    _legacy_with_wal(folder, tmp_path, "Gonedeadword", "the last whisper")
    _open_killed_at(folder, "write_bytes_atomic")  # before the sealed file exists
    assert (folder / LEGACY_FILE).exists() and not (folder / CLASP_FILE).exists()
    _open_killed_at(folder, "_shred")  # after the flush, before the plaintext goes
    assert (folder / CLASP_FILE).exists() and (folder / LEGACY_FILE).exists()
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]
    memory = _memory(folder)  # the next open finishes it
    try:
        assert _clasp_texts(memory) == ["kept whisper 1", "kept whisper 2", "the last whisper"]
    finally:
        memory.close()
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(LEGACY_FILE)) == []
    assert not any(b"whisper" in p.read_bytes() for p in folder.iterdir() if p.is_file())


def test_the_clasp_reopens_in_one_process_after_close_and_the_lock_is_one_opener(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    for round_ in range(3):  # PlayerMemory after PlayerMemory, as a turn loop or a CLI reopen does
        memory = _memory(folder)
        memory.write(f"{SECRET} {round_}", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
        assert len(_clasp_texts(memory)) == round_ + 1
        memory.close()
    first = _memory(folder)
    second = _memory(folder)
    try:
        assert len(_clasp_texts(first)) == 3
        with pytest.raises(NimmerError, match="already open"):  # same process, second opener
            _clasp_texts(second)
        assert second.retrieve("x", mode=Mode.REALWORLD) is not None  # realworld unaffected
    finally:
        first.close()
    try:
        assert len(_clasp_texts(second)) == 3  # the refused one gets in once the first closed
    finally:
        second.close()
    assert (folder / "clasp.lock").stat().st_mode & 0o077 == 0
