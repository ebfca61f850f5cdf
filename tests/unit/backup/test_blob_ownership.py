"""A failed upload removes only what it wrote: the backup id comes from the uploader's own blob,
so an upload that fails after naming another account's backup id must leave that backup whole.
Each test runs the attack against the real service on loopback (real SQLite, real blob files)."""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimmer_train.backup.device import DeviceKey
from nimmer_train.backup.sealing import Sealed, seal
from nimmer_train.backup.service import BackupClient, local_app
from tests.helpers.loopback import serve_app

PASSPHRASE = "correct horse battery staple"
LORA = bytes(range(256)) * 16


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    with serve_app(local_app(tmp_path / "host")) as url:
        yield url, tmp_path / "host"


def _device(url: str) -> BackupClient:
    client = BackupClient(url, DeviceKey.generate())
    client.register()
    return client


def _sealed(client: BackupClient, version: int) -> Sealed:
    return seal(LORA, PASSPHRASE, {"lora_name": "voice", "lora_version": version}, client.account, 1)[0]


def _claiming(attacker: BackupClient, backup_id: str, lora_name: str) -> bytes:
    """A blob sealed for the attacker's own account whose plain metadata names ``backup_id``."""
    data = json.loads(_sealed(attacker, 1).to_bytes())
    data["metadata"].update(backup_id=backup_id, lora_name=lora_name)
    return json.dumps(data).encode()  # ensure_ascii: a lone surrogate travels as "\ud800"


def _victim_intact(victim: BackupClient, folder: Path, backup_id: str) -> None:
    assert [r["backup_id"] for r in victim.list()] == [backup_id]
    assert (folder / "blobs" / backup_id).is_file()
    assert victim.restore("voice", 1, passphrase=PASSPHRASE) == LORA


def test_an_unstorable_name_carrying_another_accounts_backup_id_is_a_400_and_deletes_nothing(
    host: tuple[str, Path],
) -> None:
    """A lone surrogate passed the metadata check and failed SQLite's binding; the failure path
    then deleted ``blobs[backup_id]``, the victim's blob (a 500, and the victim's restore gone)."""
    url, folder = host
    victim, attacker = _device(url), _device(url)
    victims_id = victim.upload(_sealed(victim, 1))
    response = attacker.http.put(
        f"/accounts/{attacker.account}/backups", content=_claiming(attacker, victims_id, "\ud800")
    )
    assert response.status_code == 400, response.text
    assert "lora_name" in response.text and "Unicode" in response.text
    _victim_intact(victim, folder, victims_id)
    assert attacker.list() == []


def test_a_failing_database_is_a_503_and_leaves_another_accounts_blob(host: tuple[str, Path]) -> None:
    """The store's database fails inside the insert (a real SQLite error: a trigger whose table is
    gone, as a damaged schema would): the upload that names the victim's backup id is told to
    retry, and the victim's blob stays."""
    url, folder = host
    victim, attacker = _device(url), _device(url)
    victims_id = victim.upload(_sealed(victim, 1))
    db = sqlite3.connect(folder / "backups.sqlite", isolation_level=None)
    try:
        db.execute(
            "CREATE TRIGGER damaged BEFORE INSERT ON player_lora_backups "
            "BEGIN INSERT INTO gone VALUES (1); END"
        )
        response = attacker.http.put(
            f"/accounts/{attacker.account}/backups", content=_claiming(attacker, victims_id, "voice")
        )
        assert response.status_code == 503 and "try again" in response.text, response.text
        _victim_intact(victim, folder, victims_id)
        db.execute("DROP TRIGGER damaged")
    finally:
        db.close()
    # with the database whole again the same claim is a conflict, and still deletes nothing
    response = attacker.http.put(
        f"/accounts/{attacker.account}/backups", content=_claiming(attacker, victims_id, "voice")
    )
    assert response.status_code == 409, response.text
    _victim_intact(victim, folder, victims_id)
