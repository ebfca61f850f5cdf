"""The A.2 intake as a service (issue 25 item 3): the real FastAPI app on a loopback uvicorn,
real SQLite store and pool, real player memories on the device side. Uploads from two devices
reach the pool (read as the trainer reads it) only past k; a deletion request takes a device's
uploads out of the next training; unsigned, unenrolled, consent-less, oversize and over-rate
requests are refused with clear errors; planted player ids and device ids appear in none of the
intake's files or logs. The adversarial review's findings follow at the end: capped, off-loop
contact checks; k counting only keys with a staged upload; the operator's file forget clearing
the stage; no time or order beside uploads; uuid-only deletions and stage quotas."""

from __future__ import annotations

import json
import logging
import re
import sqlite3
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nimmer_train.backup.device import DeviceAuth, DeviceKey
from nimmer_train.cli import main
from nimmer_train.errors import NimmerError
from nimmer_train.federation.client import pool_examples
from nimmer_train.federation.intake import pooled_ids
from nimmer_train.federation.intake_service import (
    DEVICE_KEY_FILE,
    LOG_FILE,
    MAX_DELETION_IDS,
    MAX_EXAMPLES,
    MAX_VALUE_CHARS,
    POOL_FILE,
    SERVER_LOGGING,
    IntakeClient,
    IntakeStore,
    create_app,
    device_key,
    forget_through,
    local_app,
    log_to,
    send_uploads,
)
from nimmer_train.memory import contributions
from nimmer_train.memory.consent import ConsentRecord, set_consent, write_profile
from nimmer_train.memory.deletion_requests import REQUEST_FORMAT
from nimmer_train.memory.player_memory import PlayerMemory
from tests.helpers.loopback import serve_app
from tests.helpers.memory import Clock, HashEmbedder

K = 2
PLAYERS = {"player-7c1e-planted": "Ilse Varga", "player-b20d-planted": "Tomas Rindler"}


def _player(root: Path, player_id: str, name: str, tier: str = "A2_anonymized") -> PlayerMemory:
    memory = PlayerMemory(root / player_id, HashEmbedder(), clock=Clock())
    write_profile(memory.folder, player_id, name)
    set_consent(memory, ConsentRecord(tier, ("casual_dialog",), ()))
    return memory


def _say(memory: PlayerMemory, name: str, text: str) -> None:
    memory.write(f"{name} ({memory.folder.name}) {text}", name, "working", "casual_dialog")


@pytest.fixture
def intake(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The intake on a free loopback port (k=2), run as `nimmer federation a2 serve` runs it
    (its log file, uvicorn at info without the access log); its files under tmp_path/intake, and
    everything uvicorn logs also goes to intake/uvicorn.log for the search."""
    folder = tmp_path / "intake"
    folder.mkdir()
    handler = log_to(folder / LOG_FILE)
    server_log = logging.FileHandler(folder / "uvicorn.log")
    # uvicorn.access too would switch uvicorn's access log on (it logs when the logger has a handler)
    loggers = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error")]
    try:
        with serve_app(local_app(folder, K), **SERVER_LOGGING) as url:
            for logger in loggers:  # after uvicorn configured its loggers
                logger.addHandler(server_log)
            yield url, folder
    finally:
        for logger in loggers:
            logger.removeHandler(server_log)
        logging.getLogger("nimmer_train.federation.intake_service").removeHandler(handler)
        handler.close()
        server_log.close()


def _trained(folder: Path) -> str:
    return "\n".join(pool_examples(folder / POOL_FILE, K))  # what the A.2 node would train on


def test_uploads_reach_the_pool_only_past_k_and_deletion_leaves_the_next_training(
    intake: tuple[str, Path], tmp_path: Path
) -> None:
    url, folder = intake
    (a_id, a_name), (b_id, b_name) = PLAYERS.items()
    a, b = _player(tmp_path, a_id, a_name), _player(tmp_path, b_id, b_name)
    client_a, client_b = IntakeClient(url, device_key(a.folder)), IntakeClient(url, device_key(b.folder))
    _say(a, a_name, "traded the copper coil")
    (first,) = send_uploads(a, a_id, a_name, client_a)
    assert _trained(folder) == ""  # one device is below k: staged, not pooled
    _say(a, a_name, "lit the ferry lamp")
    send_uploads(a, a_id, a_name, client_a)
    assert _trained(folder) == ""  # more uploads from the same device do not pass k
    _say(b, b_name, "sang to the hive")
    send_uploads(b, b_id, b_name, client_b)
    trained = _trained(folder)  # two devices: the stage is released into the pool
    assert all(t in trained for t in ("copper coil", "ferry lamp", "sang to the hive"))
    _say(a, a_name, "sold the brass key")
    send_uploads(a, a_id, a_name, client_a)
    assert "brass key" not in _trained(folder)  # a new stage waits for k devices again
    _say(b, b_name, "mended the net")
    send_uploads(b, b_id, b_name, client_b)
    assert "brass key" in _trained(folder) and "mended the net" in _trained(folder)

    answer = forget_through(a, client_a)
    assert len(answer["dropped"]) == 3 and answer["blocked"] == []
    trained = _trained(folder)  # the next training reads B's uploads only
    assert "sang to the hive" in trained and "mended the net" in trained
    assert not any(t in trained for t in ("copper coil", "ferry lamp", "brass key"))
    (entry,) = [e for e in contributions.entries(a.folder) if e["kind"] == "deletion_answer"]
    assert len(entry["deleted"]) == 3
    resend = {"format": "nimmer-a2-upload/1", "upload_id": first, "examples": [{"text": "again"}]}
    response = client_a.http.post("/uploads", json={**resend, "consent_tier": "A2_anonymized"})
    assert response.status_code == 409 and "never pooled again" in response.text
    # the same flow from the command line: a third device's upload is staged, then forgotten
    c_id, c_name = "player-cli-planted", "Oda Brenner"
    c = _player(tmp_path, c_id, c_name)
    _say(c, c_name, "counted the lanterns")
    c.close()
    assert main(["contributions", "upload", str(c.folder), "--intake", url]) == 0
    assert main(["contributions", "forget", str(c.folder), "--intake", url]) == 0
    intake_bytes = b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())
    assert b"counted the lanterns" not in intake_bytes  # staged, forgotten: in no byte of the store or pool
    a.close(), b.close()


def test_refusals_are_clear(tmp_path: Path) -> None:
    folder = tmp_path / "intake"
    with serve_app(local_app(folder, K, max_body=4096, rate=(4, 60.0))) as url:
        anonymous = httpx.post(f"{url}/uploads", json={"upload_id": "x"})
        assert anonymous.status_code == 401 and "not signed by a device key" in anonymous.text
        stranger = httpx.Client(base_url=url, auth=DeviceAuth(DeviceKey.generate()))
        unenrolled = stranger.post("/uploads", json={"upload_id": "x"})
        assert unenrolled.status_code == 401 and "enrol its key first" in unenrolled.text
        no_consent = httpx.post(f"{url}/devices", json={"public_key": "AAAA"})
        assert no_consent.status_code == 403 and "consent_tier" in no_consent.text
        client = IntakeClient(url, DeviceKey.generate())
        client.enrol()
        body = {"format": "nimmer-a2-upload/1", "upload_id": "00000000-0000-4000-8000-000000000001"}
        unstated = client.http.post("/uploads", json={**body, "examples": [{"text": "hi"}]})
        assert unstated.status_code == 403 and "A2_anonymized" in unstated.text
        contact = {
            **body,
            "consent_tier": "A2_anonymized",
            "examples": [{"text": "mail me: a.b@example.com"}],
        }
        assert client.http.post("/uploads", json=contact).status_code == 422
        oversize = client.http.post("/uploads", content=b"x" * 5000)
        assert oversize.status_code == 413 and "limit of 4096 bytes" in oversize.text
        no_examples = client.http.post("/uploads", json={**body, "consent_tier": "A2_anonymized"})
        assert no_examples.status_code == 400 and "examples must be a non-empty list" in no_examples.text
        client.http.post("/uploads", json={**body, "consent_tier": "A2_anonymized"})  # the 4th
        over_rate = client.http.post("/uploads", json={**body, "consent_tier": "A2_anonymized"})
        assert over_rate.status_code == 429 and "4 requests per 60 s" in over_rate.text
    # the device client sends nothing without A.2 consent (an A.1 player here)
    memory = _player(tmp_path, "player-a1-planted", "Rut Falk", tier="A1_federated")
    _say(memory, "Rut Falk", "kept the ledger")
    with pytest.raises(NimmerError, match="sends no A.2 upload: the consent tier is A1_federated"):
        send_uploads(
            memory, "player-a1-planted", "Rut Falk", IntakeClient("http://127.0.0.1:9", DeviceKey.generate())
        )
    assert not (memory.folder / DEVICE_KEY_FILE).exists() and not (memory.folder / "a2-pending").exists()
    memory.close()


def test_an_unreachable_intake_keeps_the_upload_for_next_time(tmp_path: Path) -> None:
    memory = _player(tmp_path, "player-offline-planted", "Lev Ambros")
    _say(memory, "Lev Ambros", "fixed the pump")
    down = IntakeClient("http://127.0.0.1:9", device_key(memory.folder), timeout=2)
    with pytest.raises(NimmerError, match="could not reach the A.2 intake.*1 upload\\(s\\) wait in"):
        send_uploads(memory, "player-offline-planted", "Lev Ambros", down)
    with serve_app(local_app(tmp_path / "intake", 1)) as url:
        sent = send_uploads(
            memory, "player-offline-planted", "Lev Ambros", IntakeClient(url, device_key(memory.folder))
        )
    assert len(sent) == 1 and "fixed the pump" in "\n".join(pool_examples(tmp_path / "intake" / POOL_FILE, 1))
    assert list((memory.folder / "a2-pending").iterdir()) == []
    memory.close()


def test_planted_ids_reach_no_file_or_log_of_the_intake(intake: tuple[str, Path], tmp_path: Path) -> None:
    url, folder = intake
    devices = {}
    for player_id, name in PLAYERS.items():
        memory = _player(tmp_path, player_id, name)
        _say(memory, name, f"told {name} of {player_id}")  # the identifiers are in the text itself
        devices[player_id] = (memory, IntakeClient(url, device_key(memory.folder)))
        send_uploads(memory, player_id, name, devices[player_id][1])
    forget_through(*devices[next(iter(PLAYERS))])
    for memory, _ in devices.values():
        memory.close()
    planted = [t.encode() for pair in PLAYERS.items() for t in pair]
    device_files = [p for p in tmp_path.rglob("*") if p.is_file() and folder not in p.parents]
    assert all(token in b"".join(p.read_bytes() for p in device_files) for token in planted)  # findable
    files = {p.name: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    assert {"intake.sqlite", POOL_FILE, LOG_FILE, "uvicorn.log"} <= set(files)
    assert b"the stage reached k and went to the pool" in files[LOG_FILE]
    assert b"answered a deletion request" in files[LOG_FILE]
    hits = [(n, t) for n, data in files.items() for t in planted if t.lower() in data.lower()]
    assert hits == []
    # a device's id is known to authentication only: not in the pool nor any log
    accounts = [client.device.account.encode() for _, client in devices.values()]
    for name in (POOL_FILE, LOG_FILE, "uvicorn.log"):
        assert not any(a in files[name] for a in accounts), name
    assert b"POST /uploads" not in files[LOG_FILE] + files["uvicorn.log"]  # no access log (addresses)


# --- the adversarial review's findings (F1-F6), each as a test -------------------------------


def _device(url: str) -> IntakeClient:
    client = IntakeClient(url, DeviceKey.generate())
    client.enrol()
    return client


def _upload(client: IntakeClient, *texts: str, upload_id: str | None = None) -> tuple[str, httpx.Response]:
    upload_id = upload_id or str(uuid.uuid4())
    body = {"format": "nimmer-a2-upload/1", "upload_id": upload_id, "consent_tier": "A2_anonymized"}
    return upload_id, client.http.post("/uploads", json={**body, "examples": [{"text": t} for t in texts]})


def _forget(client: IntakeClient, ids: list[str]) -> httpx.Response:
    return client.http.post("/deletions", json={"format": REQUEST_FORMAT, "upload_ids": ids})


def test_long_examples_are_capped_and_checked_off_the_event_loop(tmp_path: Path) -> None:
    with serve_app(create_app(IntakeStore(tmp_path / "intake", 2))) as url:
        client = _device(url)
        _, long = _upload(client, "a." * 15000)  # the review's quadratic-regex payload
        assert long.status_code == 413 and f"at most {MAX_VALUE_CHARS} characters" in long.text
        _, many = _upload(client, *["hi"] * (MAX_EXAMPLES + 1))
        assert many.status_code == 413 and f"at most {MAX_EXAMPLES} examples" in many.text
        # the longest value allowed is checked (linear-time patterns) while another request is answered
        results: dict[str, int] = {}
        worst = threading.Thread(
            target=lambda: results.update(worst=_upload(client, "a." * (MAX_VALUE_CHARS // 2))[1].status_code)
        )
        worst.start()
        other = httpx.post(f"{url}/devices", json={"public_key": "AAAA"})  # refused: no consent stated
        worst.join()
        assert other.status_code == 403 and results == {"worst": 200}


def test_a_forgotten_upload_no_longer_counts_towards_k(tmp_path: Path) -> None:
    folder = tmp_path / "intake"
    with serve_app(create_app(IntakeStore(folder, 3))) as url:
        a, b, lone = _device(url), _device(url), _device(url)
        for client in (a, b):
            upload_id, response = _upload(client, "soon forgotten")
            assert response.status_code == 200
            assert _forget(client, [upload_id]).json()["dropped"] == [upload_id]
        lone_id, response = _upload(lone, "the lone device's text")
        assert response.status_code == 200
        assert pooled_ids(folder / POOL_FILE, 3) == []  # one key with a staged upload is below k=3
    db = sqlite3.connect(folder / "intake.sqlite")
    assert [r[0] for r in db.execute("SELECT upload_id FROM staged")] == [lone_id]
    db.close()


def test_the_operators_file_forget_clears_the_stage_and_leaves_no_trace(tmp_path: Path) -> None:
    folder = tmp_path / "intake"
    handler = log_to(folder.parent / "intake.log")  # the service's log, as `a2 serve` writes it
    try:
        with serve_app(create_app(IntakeStore(folder, 2))) as url:
            a, b, c = _device(url), _device(url), _device(url)
            a_id, _ = _upload(a, "secret-a-marker staged only")
            request = tmp_path / "deletion-request.json"
            request.write_text(json.dumps({"format": REQUEST_FORMAT, "upload_ids": [a_id]}))
            assert main(["federation", "a2", "forget", "--pool", str(folder / POOL_FILE), str(request)]) == 0
            answer = json.loads(request.with_name("deletion-request.answer.json").read_text())
            assert answer["dropped"] == [a_id] and answer["blocked"] == []
            b_id, from_b = _upload(b, "b's text")
            c_id, from_c = _upload(c, "c's text")
            assert from_b.status_code == from_c.status_code == 200 and a_id not in from_b.text + from_c.text
            assert pooled_ids(folder / POOL_FILE, 2) == sorted([b_id, c_id])  # released, A skipped
            _upload(a, "a second, still staged")
    finally:
        logging.getLogger("nimmer_train.federation.intake_service").removeHandler(handler)
        handler.close()
    assert not any(b"secret-a-marker" in p.read_bytes() for p in folder.rglob("*") if p.is_file())
    # nothing that could order or time one upload against another (F5)
    for name in ("intake.sqlite", POOL_FILE):
        db = sqlite3.connect(folder / name)
        for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
            if table == "devices":
                continue
            with pytest.raises(sqlite3.OperationalError, match="no such column: rowid"):
                db.execute(f"SELECT rowid FROM {table}")
            for column in db.execute(f"PRAGMA table_info({table})").fetchall():
                if column[2] == "REAL":
                    times = [r[0] for r in db.execute(f"SELECT {column[1]} FROM {table}")]
                    assert times and all(t % 86400 == 0 for t in times), (name, table, column[1])
        db.close()
    text = (folder.parent / "intake.log").read_text()
    assert "the stage reached k and went to the pool" in text and not re.search(r"\d\d:\d\d:\d\d", text)


def test_deletions_take_upload_ids_only_and_the_stage_has_quotas(tmp_path: Path) -> None:
    with serve_app(create_app(IntakeStore(tmp_path / "intake", 5, per_device=2, staged_bytes=400))) as url:
        a, b = _device(url), _device(url)
        bad = _forget(a, [str(uuid.uuid4()), "not-an-id"])
        assert bad.status_code == 400 and "'not-an-id', not an upload id" in bad.text
        flood = _forget(a, [str(uuid.uuid4()) for _ in range(MAX_DELETION_IDS + 1)])
        assert flood.status_code == 400 and f"at most {MAX_DELETION_IDS} upload ids" in flood.text
        assert [_upload(a, "one")[1].status_code, _upload(a, "two")[1].status_code] == [200, 200]
        third = _upload(a, "three")[1]
        assert third.status_code == 429 and "quota of 2 per device" in third.text
        full = _upload(b, "x" * 400)[1]  # over b's share of the stage: a k-th of its 400 bytes
        assert full.status_code == 429 and "quota of 80 bytes" in full.text
