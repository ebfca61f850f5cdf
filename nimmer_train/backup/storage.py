"""The backup host's side: sealed blobs and their plain metadata (the design's
player_lora_backups, keyed by a pseudonymous backup account id, never a player id).

:class:`BlobStore` is the storage interface (local files here; an S3-compatible object store fits
the same three methods); :class:`BackupStore` keeps the metadata in SQLite and the blobs in a
blob store. Nothing here can decrypt anything: it never sees a key or a passphrase.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from pathlib import Path
from typing import Protocol

from nimmer_train.backup.device import account_id, small_order
from nimmer_train.backup.sealing import UUID_RE, BackupError, Sealed

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (
    backup_account_id TEXT PRIMARY KEY,   -- derived from the device public key (backup/device.py)
    public_key BLOB NOT NULL UNIQUE,      -- raw Ed25519, 32 bytes
    registered_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS request_nonces (  -- replay protection for signed requests
    backup_account_id TEXT NOT NULL,
    nonce TEXT NOT NULL,
    seen_at REAL NOT NULL,
    PRIMARY KEY (backup_account_id, nonce)
);
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


class BackupConflict(BackupError):
    """The account already holds this LoRA version (or this backup id)."""


class BackupUnavailable(BackupError):
    """The host's database or blob store failed; nothing of the request was kept (503: retry)."""


class BackupNotFound(BackupError):
    """No such backup in the asking account (another account's backups are not revealed)."""


class BlobStore(Protocol):
    def put(self, key: str, data: bytes) -> None: ...
    def get(self, key: str) -> bytes: ...
    def delete(self, key: str) -> None: ...


class LocalBlobs:
    """Blobs as files, written to a temporary name, fsynced and renamed."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not UUID_RE.fullmatch(key):
            raise BackupError(f"blob key {key!r} is not a backup id")
        return self.folder / key

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        tmp = self.folder / f".{key}.tmp"
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(path)
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str) -> bytes:
        path = self._path(key)
        if not path.exists():
            raise BackupError(f"backup blob {key} is missing from {self.folder}")
        return path.read_bytes()

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)


class BackupStore:
    def __init__(self, db: Path, blobs: BlobStore) -> None:
        db.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(db, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.executescript(SCHEMA)
        self.blobs = blobs
        self.lock = threading.Lock()  # one connection shared by the service's worker threads

    def register(self, public_raw: bytes) -> str:
        """The account of a device public key, created on first registration (idempotent)."""
        if len(public_raw) != 32:
            raise BackupError("a device public key is 32 raw bytes (Ed25519)")
        if small_order(public_raw):
            raise BackupError("the public key is a point of small order: anyone could sign for it")
        account = account_id(public_raw)
        with self.lock:
            self.db.execute(
                "INSERT OR IGNORE INTO devices VALUES (?, ?, ?)", (account, public_raw, time.time())
            )
        return account

    def public_key(self, account: str) -> bytes | None:
        with self.lock:
            row = self.db.execute(
                "SELECT public_key FROM devices WHERE backup_account_id = ?", (account,)
            ).fetchone()
        return None if row is None else bytes(row[0])

    def use_nonce(self, account: str, nonce: str, now: float, window_s: float) -> bool:
        """Record a request nonce; False if the account already used it within the window."""
        with self.lock:
            self.db.execute("DELETE FROM request_nonces WHERE seen_at < ?", (now - window_s,))
            try:
                self.db.execute("INSERT INTO request_nonces VALUES (?, ?, ?)", (account, nonce, now))
            except sqlite3.IntegrityError:
                return False
        return True

    def put(self, account: str, blob: bytes) -> str:
        """Store a sealed backup in ``account``; the metadata comes from the blob's own plain part,
        checked in full before anything is written. Any failure leaves neither row nor blob, and
        removes only a blob this call wrote: the backup id is the uploader's to choose, so a
        failed upload must never delete whatever already sits under it (another account's)."""
        sealed = Sealed.from_bytes(blob)
        meta = sealed.metadata
        if meta["account"] != account:
            raise BackupError("the sealed backup names another backup account than the one it is uploaded to")
        with self.lock:
            try:
                self.db.execute("BEGIN IMMEDIATE")
            except sqlite3.Error as exc:
                raise BackupUnavailable(f"the backup database is busy or failing ({exc}); try again") from exc
            wrote = False
            try:
                self._insert(account, sealed)
                # the id was free (the row went in), so whatever is put under it is this call's;
                # the blob goes in inside the transaction: a row never points at nothing
                wrote = True
                self.blobs.put(meta["backup_id"], blob)
                self.db.execute("COMMIT")
            except BaseException:
                self.db.execute("ROLLBACK")
                if wrote:
                    self.blobs.delete(meta["backup_id"])
                raise
        return meta["backup_id"]

    def _insert(self, account: str, sealed: Sealed) -> None:
        """The metadata row, or the error the service maps: 409 for a version or id already
        stored, 400 for a value SQLite cannot bind, 503 for a database that fails."""
        meta = sealed.metadata
        name, version = meta["lora_name"], meta["lora_version"]
        row = (meta["backup_id"], account, name, version, sealed.method, time.time(), meta["size_bytes"])
        try:
            self.db.execute("INSERT INTO player_lora_backups VALUES (?, ?, ?, ?, ?, ?, ?)", row)
        except sqlite3.IntegrityError as exc:
            raise BackupConflict(
                f"{name!r} version {version} (or this backup id) is already backed up"
            ) from exc
        except (ValueError, OverflowError, sqlite3.InterfaceError, sqlite3.DataError) as exc:
            raise BackupError(f"the backup's metadata cannot be stored: {exc}") from exc
        except sqlite3.Error as exc:
            raise BackupUnavailable(f"the backup database failed ({exc}); try again") from exc

    def get(self, account: str, backup_id: str) -> bytes:
        """The blob of ``backup_id`` if ``account`` owns it."""
        with self.lock:
            row = self.db.execute(
                "SELECT 1 FROM player_lora_backups WHERE backup_id = ? AND backup_account_id = ?",
                (backup_id, account),
            ).fetchone()
        if not row:
            raise BackupNotFound(f"no backup {backup_id} in this account")
        return self.blobs.get(backup_id)

    def list(self, account: str) -> list[dict]:
        with self.lock:
            rows = self.db.execute(
                "SELECT backup_id, lora_name, lora_version, encryption_method, backed_up_at, size_bytes "
                "FROM player_lora_backups WHERE backup_account_id = ? ORDER BY lora_name, lora_version",
                (account,),
            ).fetchall()
        keys = ("backup_id", "lora_name", "lora_version", "encryption_method", "backed_up_at", "size_bytes")
        return [dict(zip(keys, row, strict=True)) for row in rows]
