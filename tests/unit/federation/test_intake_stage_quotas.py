"""Fewer than k keys cannot hold the A.2 intake's stage (the real app on a loopback uvicorn, real
SQLite store and pool): a key may stage a k-th of the stage's bytes (429 past it), a staged
upload expires after a TTL, and after a restart the rows no key owns (owners live in memory only)
are dropped, so an honest device still gets 2xx, also after a restart."""

from __future__ import annotations

import sqlite3
import time
import uuid
from pathlib import Path

import pytest

from nimmer_train.backup.device import DeviceKey
from nimmer_train.federation.intake_service import IntakeClient, IntakeStore, create_app
from tests.helpers.loopback import serve_app

K, STAGE_BYTES = 5, 6000  # one key's share: 1200 bytes


def _device(url: str) -> IntakeClient:
    client = IntakeClient(url, DeviceKey.generate())
    client.enrol()
    return client


def _upload(client: IntakeClient, text: str) -> int:
    body = {"format": "nimmer-a2-upload/1", "upload_id": str(uuid.uuid4()), "consent_tier": "A2_anonymized"}
    return client.http.post("/uploads", json={**body, "examples": [{"text": text}]}).status_code


def _fill(url: str, keys: int) -> list[int]:
    """``keys`` fresh keys each upload until refused (at most 20 tries each); every answer."""
    answers = []
    for _ in range(keys):
        attacker = _device(url)
        for _ in range(20):
            answers.append(_upload(attacker, "x" * 500))
            if answers[-1] != 200:
                break
    return answers


def _staged(folder: Path) -> int:
    db = sqlite3.connect(folder / "intake.sqlite")
    try:
        return db.execute("SELECT COUNT(*) FROM staged").fetchone()[0]
    finally:
        db.close()


def _store(folder: Path, ttl_s: float = 3600.0) -> IntakeStore:
    return IntakeStore(folder, K, per_device=20, staged_bytes=STAGE_BYTES, ttl_s=ttl_s)


def test_three_keys_cannot_fill_the_stage_and_a_restart_frees_what_they_held(tmp_path: Path) -> None:
    folder = tmp_path / "intake"
    with serve_app(create_app(_store(folder))) as url:
        answers = _fill(url, 3)
        assert answers.count(429) == 3 and 507 not in answers  # each key stopped at its share
        assert _upload(_device(url), "an honest line") == 200
    assert _staged(folder) > 0
    with serve_app(create_app(_store(folder))) as url:  # a restart: no key owns the staged rows
        assert _staged(folder) == 0
        answers = _fill(url, 3)
        assert answers.count(429) == 3 and 507 not in answers
        assert _upload(_device(url), "an honest line after the restart") == 200


class _Clock:
    """The intake service's clock (its module's ``time`` alone), moved on by the test: a TTL
    expires when the test says so, not when a stalled worker lets a real second pass."""

    def __init__(self) -> None:
        self.offset = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.offset

    def time(self) -> float:
        return time.time() + self.offset


def test_a_staged_upload_expires_and_frees_its_keys_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nimmer_train.federation import intake_service

    clock = _Clock()
    monkeypatch.setattr(intake_service, "time", clock)
    folder = tmp_path / "intake"
    with serve_app(create_app(_store(folder, ttl_s=60.0))) as url:
        attacker = _device(url)
        assert [_upload(attacker, "x" * 500) for _ in range(3)] == [200, 200, 429]
        clock.offset += 61  # past the TTL: the next upload prunes the expired ones first
        assert _upload(attacker, "x" * 500) == 200
        assert _staged(folder) == 1
