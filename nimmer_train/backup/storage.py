"""The backup host's side: sealed blobs and their plain metadata (the design's
player_lora_backups, keyed by a pseudonymous backup account id, never a player id).

:class:`BlobStore` is the storage interface (local files here; an S3-compatible object store fits
the same three methods); :class:`BackupStore` keeps the metadata in SQLite and the blobs in a
blob store. Nothing here can decrypt anything: it never sees a key or a passphrase.
"""

from __future__ import annotations

import os
import sqlite3
import time
import uuid
from pathlib import Path
from typing import Protocol

from nimmer_train.backup.sealing import BackupError, Sealed

SCHEMA = """
CREATE TABLE IF NOT EXISTS player_lora_backups (
    backup_id TEXT PRIMARY KEY,
    backup_account_id TEXT NOT NULL,
    lora_name TEXT NOT NULL,
    lora_version INTEGER NOT NULL,
    encryption_method TEXT NOT NULL,
    backed_up_at REAL NOT NULL,
    size_bytes INTEGER NOT NULL,
    UNIQUE (backup_account_id, lora_name, lora_version)
);
"""


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def delete(self, key: str) -> None: ...


class LocalBlobs:
    """Blobs as files, written to a temporary name, fsynced and renamed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def put(self, key: str, data: bytes) -> None:
        tmp = self.folder / f".{key}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(self.folder / key)

    def get(self, key: str) -> bytes:
        path = self.folder / key
        if not path.exists():
            raise BackupError(f"backup blob {key} is missing from {self.folder}")
        return path.read_bytes()

    def delete(self, key: str) -> None:
        (self.folder / key).unlink(missing_ok=True)


class BackupStore:
    def __init__(self, db: Path, blobs: BlobStore) -> None:
        db.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.blobs = blobs

    def put(self, account: str, blob: bytes) -> str:
        """Store a sealed backup; the metadata comes from the blob's own plain part."""
        sealed = Sealed.from_bytes(blob)
        meta = sealed.metadata
        try:
            name, version, size = str(meta["lora_name"]), int(meta["lora_version"]), int(meta["size_bytes"])
        except (KeyError, ValueError) as exc:
            raise BackupError(
                "a sealed backup needs lora_name, lora_version and size_bytes metadata"
            ) from exc
        backup_id = str(uuid.uuid4())
        self.blobs.put(backup_id, blob)  # blob first: a row never points at nothing
        try:
            self.db.execute(
                "INSERT INTO player_lora_backups VALUES (?, ?, ?, ?, ?, ?, ?)",
                (backup_id, account, name, version, sealed.method, time.time(), size),
            )
        except sqlite3.IntegrityError as exc:
            self.blobs.delete(backup_id)
            raise BackupError(f"{name} version {version} is already backed up for this account") from exc
        return backup_id

    def get(self, backup_id: str) -> bytes:
        if not self.db.execute(
            "SELECT 1 FROM player_lora_backups WHERE backup_id = ?", (backup_id,)
        ).fetchone():
            raise BackupError(f"no backup {backup_id}")
        return self.blobs.get(backup_id)

    def list(self, account: str) -> list[dict]:
        rows = self.db.execute(
            "SELECT backup_id, lora_name, lora_version, encryption_method, backed_up_at, size_bytes "
            "FROM player_lora_backups WHERE backup_account_id = ? ORDER BY lora_name, lora_version",
            (account,),
        ).fetchall()
        keys = ("backup_id", "lora_name", "lora_version", "encryption_method", "backed_up_at", "size_bytes")
        return [dict(zip(keys, row, strict=True)) for row in rows]
