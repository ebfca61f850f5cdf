"""The clasp channel: the only module that may open the clasp store.

The clasp store holds the in-between intimate channel. It is read for one purpose, retrieval in
IN_BETWEEN mode, and written only by turns spoken in that mode. No export, sync, upload or
training reader may open it: nothing outside this module names its files, and
tests/unit/memory/test_memory.py scans the package to keep it that way.

**Sealed at rest** (design: "Encryption-at-rest for clasp.sqlite with a player-derived key"; issue
26: "key held by the device, sealed like the backups"). The store is never plaintext on disk: it
lives in :data:`CLASP_FILE` only as ciphertext, and while open as an in-memory SQLite database
(FTS5 and vec0 need plaintext pages, and sealing single fields would leave the embeddings, which
can be inverted, in clear). :func:`open_clasp` unseals the file into memory; every committed
write is flushed by serialize -> seal -> atomic replace (temp file, fsync, rename, fsync the
folder), so a kill mid-write leaves the previous sealed file. Deleted pages are zeroed
(secure_delete) and temp data stays in memory (temp_store), so nothing spills to disk.

The file: :data:`MAGIC`, one JSON header line ``{"key": <Sealed>, "nonce": ...}``, then the
database image under AES-256-GCM with a random store key (the header is the AAD). The store key
is sealed with the backup sealing code (``backup/sealing.py``: AES-256-GCM under scrypt) under the
device's runtime key (``runtime.key``, mode 0600, the one that seals the BYOK keys), once, when the
store is made; it is unwrapped once per open, so a write costs one AES pass and no key derivation.

A plaintext :data:`LEGACY_FILE` (stores from before issue 26) is migrated on first open: every
row is kept, the sealed file is written and synced, then the plaintext file and its -wal/-shm are
overwritten with zeros and removed. One opener at a time (a flock on :data:`LOCK_FILE`): the
store lives in the opener's memory, so a second one would overwrite its writes.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import json
import os
from pathlib import Path
from typing import IO, Any

import apsw
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from nimmer_train.artifacts import write_bytes_atomic
from nimmer_train.backup.sealing import BackupError, Sealed, seal, unseal
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import connect, migrate
from nimmer_train.memory.llm_config import KEY_FILE, device_secret
from nimmer_train.memory.schema import CLASP_MIGRATIONS

CLASP_FILE = "clasp.sealed"
LEGACY_FILE = "clasp.sqlite"  # the plaintext store of before issue 26; migrated, then removed
LOCK_FILE = "clasp.lock"
MAGIC = b"nimmer-clasp-sealed-v1\n"
KEY_NAME = "clasp-store-key"  # the sealed store key's lora_name (the sealing code's metadata field)
MAX_HEADER = 64 * 1024


def clasp_exists(folder: Path) -> bool:
    """Whether ``folder`` holds a clasp store (sealed, or plaintext from before issue 26)."""
    return (folder / CLASP_FILE).exists() or (folder / LEGACY_FILE).exists()


class ClaspStore(apsw.Connection):
    """The clasp store, open in memory; every committed write is sealed to :data:`CLASP_FILE`.

    A commit (a ``with db:`` block, or a statement run outside one) is flushed when it ends; a
    failed flush raises and is retried at the next commit or at :meth:`close`. The file on disk
    stays the last one sealed."""

    path: Path
    _key: bytes
    _wrapped: Sealed
    _lock: IO[bytes] | None = None
    _dirty: bool = False
    _ready: bool = False  # no flush while open_clasp builds the store (it flushes once, at the end)

    def _committed(self) -> bool:
        self._dirty = True
        return False  # let the commit go ahead

    def _after(self) -> None:
        if self._dirty and self._ready and self.getautocommit():
            self.flush()

    def __exit__(self, *exc: Any) -> Any:
        out = super().__exit__(*exc)
        self._after()
        return out

    def execute(self, *args: Any, **kwargs: Any) -> apsw.Cursor:
        cursor = super().execute(*args, **kwargs)
        self._after()
        return cursor

    def executemany(self, *args: Any, **kwargs: Any) -> apsw.Cursor:
        cursor = super().executemany(*args, **kwargs)
        self._after()
        return cursor

    def flush(self) -> None:
        """Seal the store as it is now and replace the file atomically."""
        try:
            write_bytes_atomic(self.path, _seal_image(self.serialize("main"), self._key, self._wrapped), True)
        except OSError as exc:
            raise NimmerError(
                f"could not write the sealed clasp store {self.path}: {exc}; the file there is the "
                "last one sealed, and this change is kept in memory and written at the next commit "
                "or at close (free disk space or fix the folder's permissions)"
            ) from exc
        self._dirty = False

    def reset(self) -> None:
        """Replace the whole store with an empty one (no page of the old one is kept) and seal it."""
        fresh = connect(Path(":memory:"))
        migrate(fresh, CLASP_MIGRATIONS, self.path)
        image = fresh.serialize("main")
        fresh.close()
        self.deserialize("main", image)
        _harden(self)
        self.flush()

    def close(self, force: bool = False) -> None:
        """Flush what is not sealed yet, then close and let the next opener in (even when the
        flush fails: that error is raised after the store is closed)."""
        try:
            if self._dirty and self._ready:
                self.flush()
        finally:
            self._ready = False
            super().close(force)
            if self._lock is not None:
                self._lock.close()
                self._lock = None


def open_clasp(folder: Path) -> ClaspStore:
    """The player's clasp store, for in-between retrieval and in-between writes only."""
    folder.mkdir(parents=True, exist_ok=True)
    path, legacy = folder / CLASP_FILE, folder / LEGACY_FILE
    lock = _lock(folder)
    try:
        for stale in folder.glob(f".{CLASP_FILE}.tmp-*"):  # a flush killed before its rename
            stale.unlink(missing_ok=True)
        secret = device_secret(folder)
        db = connect(Path(":memory:"), ClaspStore)
    except BaseException:
        lock.close()
        raise
    db.path, db._lock = path, lock
    try:
        if path.exists():
            image, db._key, db._wrapped = _unseal_file(path, secret, folder / KEY_FILE)
            db.deserialize("main", image)
        else:
            db._key = AESGCM.generate_key(bit_length=256)
            db._wrapped, _ = seal(
                db._key,
                secret,
                {"lora_name": KEY_NAME, "lora_version": 0},
                account="device",
                recovery_codes=0,
            )
            if legacy.exists():
                db.deserialize("main", _plain_image(legacy))
        _harden(db)
        db.set_commit_hook(db._committed)
        before = db.execute("PRAGMA user_version").fetchone()[0]
        migrate(db, CLASP_MIGRATIONS, path)
        db._ready = True
        if not path.exists() or before != len(CLASP_MIGRATIONS):
            db.flush()
    except BaseException:
        db.close()
        raise
    for suffix in ("", "-wal", "-shm"):  # migrated (or a migration killed after its flush)
        _shred(Path(f"{legacy}{suffix}"))
    return db


def clear_clasp(db: ClaspStore) -> int:
    """Empty the clasp store (the design: its entries "persist until character-death"); returns
    how many entries went. Everything goes (entries, vectors, crystals, audit, the search log of
    in-between queries): the store is replaced by an empty one and sealed; nothing is copied."""
    count = db.execute("SELECT count(*) FROM entries").fetchone()[0]
    db.reset()
    return int(count)


def _harden(db: apsw.Connection) -> None:
    db.execute("PRAGMA secure_delete=ON")  # freed pages are zeroed, in the image that gets sealed
    db.execute("PRAGMA temp_store=MEMORY")  # sorts and temp tables never spill to a file


def _lock(folder: Path) -> IO[bytes]:
    fh = os.fdopen(os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600), "r+b")  # held while open
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise NimmerError(
            f"the clasp store {folder / CLASP_FILE} is already open (another process or PlayerMemory "
            f"holds {LOCK_FILE}); it lives in its opener's memory, so close that one first"
        ) from None
    return fh


def _seal_image(image: bytes, key: bytes, wrapped: Sealed) -> bytes:
    nonce = os.urandom(12)
    header = json.dumps(
        {"key": json.loads(wrapped.to_bytes()), "nonce": base64.b64encode(nonce).decode()}, sort_keys=True
    ).encode()
    aad = MAGIC + header + b"\n"
    return aad + AESGCM(key).encrypt(nonce, image, aad)


def _unseal_file(path: Path, secret: str, key_file: Path) -> tuple[bytes, bytes, Sealed]:
    """The database image, the store key and its sealed form; a clear error for a wrong key, a
    changed byte or a file that is not a sealed clasp store."""
    blob = path.read_bytes()
    end = blob.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER)
    move_aside = f"or move {path.name} aside to start an empty clasp (what it holds stays unreadable)"
    try:
        if not blob.startswith(MAGIC) or end < 0:
            raise ValueError("it does not start with the sealed clasp header")
        header = json.loads(blob[len(MAGIC) : end])
        wrapped = Sealed.from_bytes(json.dumps(header["key"]).encode())
        nonce = base64.b64decode(header["nonce"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error, BackupError) as exc:
        raise NimmerError(
            f"{path} is not a readable sealed clasp store ({exc}); restore it, {move_aside}"
        ) from exc
    try:
        key = unseal(wrapped, passphrase=secret, expect={"lora_name": KEY_NAME})
    except BackupError as exc:
        raise NimmerError(
            f"{path} cannot be unsealed with this device's key {key_file} (a wrong key, or the file "
            f"was changed): {exc}. Put back the runtime.key that sealed it, {move_aside}"
        ) from exc
    try:
        return AESGCM(key).decrypt(nonce, blob[end + 1 :], blob[: end + 1]), key, wrapped
    except (InvalidTag, ValueError) as exc:
        raise NimmerError(
            f"{path} was changed or is corrupt (its authentication failed; nothing was read): "
            f"restore it, {move_aside}"
        ) from exc


def _plain_image(legacy: Path) -> bytes:
    """The database image of a plaintext clasp store, WAL folded in and in rollback-journal mode
    (an in-memory database cannot read a WAL-mode image)."""
    db = connect(legacy)
    try:
        db.execute("PRAGMA journal_mode=DELETE")
        return db.serialize("main")
    finally:
        db.close()


def _shred(path: Path) -> None:
    """Overwrite with zeros, sync and remove (best effort: a file system may keep old blocks)."""
    if not path.exists():
        return
    size = path.stat().st_size
    with open(path, "r+b") as fh:
        fh.write(bytes(size))
        fh.flush()
        os.fsync(fh.fileno())
    path.unlink()
