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
folder), so a kill mid-write leaves the previous sealed file. A flush that fails (a full disk)
does not undo the commit, so the writer is not told it failed: it is logged as an error naming
the file, and the change is sealed at the next commit or at :meth:`ClaspStore.close`, which
raises if it still cannot (the loss is never silent). Deleted pages are zeroed (secure_delete)
and temp data stays in memory (temp_store), so nothing spills to disk.

The file: :data:`MAGIC`, one JSON header line ``{"key": <wrapped store key>, "nonce": ...}``,
then the database image under AES-256-GCM with a random store key (the header is the AAD). The
store key is wrapped with AES-256-GCM, once, when the store is made, under a key derived by
HKDF-SHA256 from the device's runtime secret (``runtime.key``, mode 0600, the one that seals the
BYOK keys). That secret is a random 256-bit token, not a passphrase, so it needs no stretching:
scrypt (the backup code's KDF, made for passphrases) would cost 0.5-1 s and 128 MiB per store
opened, on every synthetic player of a federation. A write costs one AES pass of the image.

A plaintext :data:`LEGACY_FILE` (stores from before issue 26) is migrated on first open: every
row is kept, but nothing the old code deleted (the image is vacuumed and its full-text index
rebuilt before the first seal); the sealed file is written and synced, then the plaintext file
and its -wal/-shm are overwritten with zeros and removed (the -wal that SQLite deletes itself when
the WAL is folded in is zeroed first, by :class:`_ShreddingVFS`). The sealed store records a
digest of the rows it migrated, so a plaintext file found beside it later is shredded only when
it is that same copy (a migration killed after its flush); one holding anything else (an older
build ran in between) is refused, naming both files, and neither loses a row.

One opener at a time (a flock on :data:`LOCK_FILE`): the store lives in the opener's memory, so
a second one would overwrite its writes; it gets :class:`ClaspBusy`, which callers that can wait
(the transcript indexer, consolidation) tell apart from a refusal. Not detected: an older
``clasp.sealed`` put back by hand (a file-level backup from before a death) opens as it was.
"""

from __future__ import annotations

import base64
import binascii
import fcntl
import functools
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import IO, Any

import apsw
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from nimmer_train.artifacts import write_bytes_atomic
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import connect, get_meta, migrate, set_meta
from nimmer_train.memory.llm_config import KEY_FILE, MIN_SECRET_CHARS, device_secret
from nimmer_train.memory.schema import CLASP_MIGRATIONS

CLASP_FILE = "clasp.sealed"
LEGACY_FILE = "clasp.sqlite"  # the plaintext store of before issue 26; migrated, then removed
LOCK_FILE = "clasp.lock"
MAGIC = b"nimmer-clasp-sealed-v2\n"
KEY_INFO = b"nimmer clasp store key v2"  # HKDF info, and the wrapped key's AAD
MAX_HEADER = 64 * 1024
MIGRATED_META = "migrated_legacy_digest"  # memory_meta key: the digest of the rows migrated from LEGACY_FILE
SHREDDING_VFS = "nimmer-clasp-shredding"
log = logging.getLogger(__name__)


class ClaspBusy(NimmerError):
    """The clasp store is open elsewhere (another process or PlayerMemory holds its lock): a
    retry after that opener closes can succeed, unlike a refusal."""


def clasp_exists(folder: Path) -> bool:
    """Whether ``folder`` holds a clasp store (sealed, or plaintext from before issue 26)."""
    return (folder / CLASP_FILE).exists() or (folder / LEGACY_FILE).exists()


class ClaspStore(apsw.Connection):
    """The clasp store, open in memory; every committed write is sealed to :data:`CLASP_FILE`.

    A commit (a ``with db:`` block, or a statement run outside one) is flushed when it ends; a
    failed flush is logged (the commit stands) and retried at the next commit and at
    :meth:`close`, which raises if it still fails. The file on disk stays the last one sealed."""

    path: Path
    _key: bytes
    _wrapped: dict[str, str]
    _lock: IO[bytes] | None = None
    _dirty: bool = False
    _ready: bool = False  # no flush while open_clasp builds the store (it flushes once, at the end)

    def _committed(self) -> bool:
        self._dirty = True
        return False  # let the commit go ahead

    def _after(self) -> None:
        if self._dirty and self._ready and self.getautocommit():
            self._flush_or_log()

    def _flush_or_log(self) -> None:
        """Flush; a failure is logged, not raised: the commit happened (the writer must not retry
        it), and the store stays dirty, so the next commit or close seals it."""
        try:
            self.flush()
        except NimmerError as exc:
            log.error("%s", exc)

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
        self._dirty = True
        self._flush_or_log()

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
        migrated = None  # the digest of the legacy rows this open migrates
        if path.exists():
            image, db._key, db._wrapped = _unseal_file(path, secret, folder / KEY_FILE)
            db.deserialize("main", image)
        else:
            db._key = AESGCM.generate_key(bit_length=256)
            db._wrapped = _wrap(db._key, secret)
            if legacy.exists():
                db.deserialize("main", _plain_image(legacy))
                migrated = _digest(_rows(db))
        _harden(db)
        db.set_commit_hook(db._committed)
        before = db.execute("PRAGMA user_version").fetchone()[0]
        migrate(db, CLASP_MIGRATIONS, path)
        if migrated is not None:
            _drop_deleted(db)
            with db:
                set_meta(db, MIGRATED_META, migrated)
        elif legacy.exists():
            _check_migrated_copy(db, legacy)
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


def _rows(db: apsw.Connection) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in db.execute("SELECT event_uid, text FROM entries ORDER BY event_uid")]


def _digest(rows: list[tuple[str, str]]) -> str:
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()


def _drop_deleted(db: apsw.Connection) -> None:
    """Leave no trace of what a legacy store had deleted (its DELETEs kept the old cells and free
    pages, and FTS5 keeps a deleted row's terms until a merge): rebuild the full-text index, then
    VACUUM the image, before it is first sealed."""
    with db:
        db.execute("INSERT INTO entries_fts (entries_fts) VALUES ('rebuild')")
    db.execute("VACUUM")


def _check_migrated_copy(db: ClaspStore, legacy: Path) -> None:
    """``legacy`` beside the sealed store: fine (shredded next) when it holds exactly the rows the
    sealed store was migrated from (a migration killed after its flush); else refused, unchanged."""
    copy = connect(Path(":memory:"))
    try:
        copy.deserialize("main", _plain_image(legacy))
        rows = _rows(copy)
    except apsw.Error as exc:
        raise NimmerError(
            f"{legacy} beside {db.path} cannot be read as a clasp store ({exc}); nothing was "
            f"changed: move {legacy.name} aside"
        ) from exc
    finally:
        copy.close()
    if _digest(rows) == get_meta(db, MIGRATED_META):
        return
    sealed = {uid for uid, _ in _rows(db)}
    only = sum(uid not in sealed for uid, _ in rows)
    raise NimmerError(
        f"{legacy} (plaintext, {len(rows)} entries, {only} of them not in {db.path.name}) is not "
        f"the copy {db.path} was migrated from: an older build wrote it after the migration. "
        f"Neither was changed (but for its WAL, folded in). Move {legacy.name} aside to keep "
        f"{db.path.name} (its entries stay unread), or move {db.path.name} aside to migrate "
        f"{legacy.name} in its place"
    )


def _harden(db: apsw.Connection) -> None:
    db.execute("PRAGMA secure_delete=ON")  # freed pages are zeroed, in the image that gets sealed
    db.execute("PRAGMA temp_store=MEMORY")  # sorts and temp tables never spill to a file


def _lock(folder: Path) -> IO[bytes]:
    fh = os.fdopen(os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600), "r+b")  # held while open
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        fh.close()
        raise ClaspBusy(
            f"the clasp store {folder / CLASP_FILE} is already open (another process or PlayerMemory "
            f"holds {LOCK_FILE}); it lives in its opener's memory, so close that one first"
        ) from None
    return fh


def _kek(secret: str) -> AESGCM:
    """The key that wraps store keys: HKDF-SHA256 of the device's random secret. HKDF does not
    stretch, so a short secret ("" from a key file cut short) would let the sealed file alone be
    opened: refused here too, whoever passes it."""
    if len(secret) < MIN_SECRET_CHARS:
        raise NimmerError(
            f"the device secret has {len(secret)} characters; the clasp is sealed only under a "
            f"{KEY_FILE} of at least {MIN_SECRET_CHARS}"
        )
    return AESGCM(
        HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=KEY_INFO).derive(secret.encode())
    )


def _wrap(key: bytes, secret: str) -> dict[str, str]:
    nonce = os.urandom(12)
    sealed = _kek(secret).encrypt(nonce, key, KEY_INFO)
    return {
        "kdf": "hkdf-sha256",
        "nonce": base64.b64encode(nonce).decode(),
        "ct": base64.b64encode(sealed).decode(),
    }


def _seal_image(image: bytes, key: bytes, wrapped: dict[str, str]) -> bytes:
    nonce = os.urandom(12)
    header = json.dumps({"key": wrapped, "nonce": base64.b64encode(nonce).decode()}, sort_keys=True).encode()
    aad = MAGIC + header + b"\n"
    return aad + AESGCM(key).encrypt(nonce, image, aad)


def _unseal_file(path: Path, secret: str, key_file: Path) -> tuple[bytes, bytes, dict[str, str]]:
    """The database image, the store key and its sealed form; a clear error for a wrong key, a
    changed byte or a file that is not a sealed clasp store."""
    blob = path.read_bytes()
    end = blob.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER)
    move_aside = f"or move {path.name} aside to start an empty clasp (what it holds stays unreadable)"
    try:
        if not blob.startswith(MAGIC) or end < 0:
            raise ValueError("it does not start with the sealed clasp header")
        header = json.loads(blob[len(MAGIC) : end])
        wrapped = {k: str(header["key"][k]) for k in ("kdf", "nonce", "ct")}
        if wrapped["kdf"] != "hkdf-sha256":
            raise ValueError(f"unknown key wrapping {wrapped['kdf']!r}")
        key_nonce = base64.b64decode(wrapped["nonce"], validate=True)
        key_ct = base64.b64decode(wrapped["ct"], validate=True)
        nonce = base64.b64decode(header["nonce"], validate=True)
    except (ValueError, KeyError, TypeError, binascii.Error) as exc:
        raise NimmerError(
            f"{path} is not a readable sealed clasp store ({exc}); restore it, {move_aside}"
        ) from exc
    try:
        key = _kek(secret).decrypt(key_nonce, key_ct, KEY_INFO)
    except (InvalidTag, ValueError) as exc:
        raise NimmerError(
            f"{path} cannot be unsealed with this device's key {key_file} (a wrong key, or the file "
            f"was changed). Put back the runtime.key that sealed it, {move_aside}"
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
    (an in-memory database cannot read a WAL-mode image). SQLite deletes the -wal itself when
    it leaves WAL mode; :class:`_ShreddingVFS` zeroes it first."""
    _shredding_vfs()
    db = connect(legacy, _LegacyConnection)
    try:
        db.execute("PRAGMA journal_mode=DELETE")
        return db.serialize("main")
    finally:
        db.close()


def _shred(path: Path) -> None:
    """Overwrite with zeros, sync and remove (best effort: a file system may keep old blocks)."""
    if _overwrite(path):
        path.unlink()


def _overwrite(path: Path) -> bool:
    """Overwrite the file with zeros and sync it; False when there is no such file."""
    try:
        fh = open(path, "r+b")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return False
    with fh:
        fh.write(bytes(os.fstat(fh.fileno()).st_size))
        fh.flush()
        os.fsync(fh.fileno())
    return True


class _ShreddingVFS(apsw.VFS):
    """SQLite's unix VFS, except that a file SQLite deletes is overwritten with zeros first (the
    base is named, not "the default": a VFS a test made the default may be gone later)."""

    def __init__(self) -> None:
        super().__init__(SHREDDING_VFS, base="unix")

    def xDelete(self, filename: str, syncdir: bool) -> None:  # noqa: N802 - apsw's name
        _overwrite(Path(filename))
        super().xDelete(filename, syncdir)


@functools.cache
def _shredding_vfs() -> _ShreddingVFS:
    return _ShreddingVFS()  # registered once; kept alive by the cache


class _LegacyConnection(apsw.Connection):
    """A connection to a plaintext legacy store, through :class:`_ShreddingVFS`."""

    def __init__(self, filename: str) -> None:
        super().__init__(filename, vfs=SHREDDING_VFS)
