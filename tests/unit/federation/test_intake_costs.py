"""What one signed request may cost the A.2 intake (the real app on a loopback uvicorn, real
SQLite store and pool): an upload is capped in characters (the contact-detail check is linear in
them), a key's deletion requests are capped in upload ids per day (each id not pooled becomes a
row of the pool's deletions), and a deletion does its work outside the stage's lock, so an honest
upload is not held behind one."""

from __future__ import annotations

import sqlite3
import threading
import uuid
from pathlib import Path

import httpx
import pytest

from nimmer_train.backup.device import DeviceKey
from nimmer_train.federation.intake_service import (
    MAX_UPLOAD_CHARS,
    MAX_VALUE_CHARS,
    POOL_FILE,
    IntakeClient,
    IntakeStore,
    StageFull,
    create_app,
)
from nimmer_train.memory.deletion_requests import REQUEST_FORMAT
from tests.helpers.loopback import serve_app


def _device(url: str) -> IntakeClient:
    client = IntakeClient(url, DeviceKey.generate())
    client.enrol()
    return client


def _upload(client: IntakeClient, *texts: str, timeout: float = 30) -> int:
    body = {"format": "nimmer-a2-upload/1", "upload_id": str(uuid.uuid4()), "consent_tier": "A2_anonymized"}
    examples = [{"text": t} for t in texts]
    return client.http.post("/uploads", json={**body, "examples": examples}, timeout=timeout).status_code


def _forget(client: IntakeClient, n: int) -> httpx.Response:
    ids = [str(uuid.uuid4()) for _ in range(n)]
    return client.http.post("/deletions", json={"format": REQUEST_FORMAT, "upload_ids": ids})


def test_an_upload_over_the_character_cap_is_refused_naming_it(tmp_path: Path) -> None:
    with serve_app(create_app(IntakeStore(tmp_path / "intake", 2), max_body=2**21)) as url:
        client = _device(url)
        per_value = MAX_VALUE_CHARS - 10
        texts = ["a." * (per_value // 2)] * (MAX_UPLOAD_CHARS // per_value + 1)  # each value allowed
        response = client.http.post(
            "/uploads",
            json={
                "format": "nimmer-a2-upload/1",
                "upload_id": str(uuid.uuid4()),
                "consent_tier": "A2_anonymized",
                "examples": [{"text": t} for t in texts],
            },
        )
        assert response.status_code == 413 and f"at most {MAX_UPLOAD_CHARS} characters" in response.text
        assert _upload(client, "a." * (per_value // 2)) == 200  # one such value is fine


def test_a_keys_deletions_past_its_quota_are_refused(tmp_path: Path) -> None:
    folder = tmp_path / "intake"
    with serve_app(create_app(IntakeStore(folder, 2), deletion_quota=(150, 3600.0))) as url:
        flooder, other = _device(url), _device(url)
        assert _forget(flooder, 100).status_code == 200
        over = _forget(flooder, 100)
        assert over.status_code == 429 and "150 upload ids per 3600 s per device key" in over.text
        assert _forget(flooder, 50).status_code == 200  # what is left of the quota
        assert _forget(other, 100).status_code == 200  # a quota per key
    db = sqlite3.connect(folder / POOL_FILE)
    assert db.execute("SELECT COUNT(*) FROM deletions").fetchone() == (250,)  # the refused ids: no rows
    db.close()


def test_a_full_deletions_table_refuses_more_with_507(tmp_path: Path) -> None:
    store = IntakeStore(tmp_path / "intake", 2)
    store.forget([str(uuid.uuid4()) for _ in range(3)], max_rows=5)
    with pytest.raises(StageFull, match="3 of 5 ids") as refused:
        store.forget([str(uuid.uuid4()) for _ in range(3)], max_rows=5)
    assert refused.value.status == 507
    store.close()


def test_an_honest_upload_is_not_held_behind_a_deletion(tmp_path: Path) -> None:
    """A deletion waiting on the pool (here: the test holds the pool's write lock, as a long
    deletion or release would) must not hold the stage: an upload below k is answered meanwhile."""
    folder = tmp_path / "intake"
    with serve_app(create_app(IntakeStore(folder, 2))) as url:
        flooder, honest = _device(url), _device(url)
        holder = sqlite3.connect(folder / POOL_FILE, isolation_level=None)
        holder.execute("BEGIN IMMEDIATE")  # the pool's write lock, released below
        answers: dict[str, int] = {}
        deletion = threading.Thread(
            target=lambda: answers.update(deletion=_forget(flooder, 1000).status_code)
        )
        deletion.start()
        try:
            deletion.join(timeout=0.5)  # the deletion is now waiting on the pool
            assert deletion.is_alive()
            assert _upload(honest, "mended the net", timeout=3) == 200  # the stage was free
            assert deletion.is_alive()  # answered while the deletion still waited
        finally:
            holder.execute("ROLLBACK")
            holder.close()
            deletion.join(timeout=30)
        assert answers == {"deletion": 200}
