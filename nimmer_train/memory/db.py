"""SQLite connections for player stores: apsw (this Python's sqlite3 cannot load extensions)
with sqlite-vec loaded, WAL journaling, and versioned schema migrations (PRAGMA user_version)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from nimmer_train.errors import NimmerError

try:
    import apsw
    import sqlite_vec
except ImportError as exc:  # said clearly at start-up, not at the first query
    raise NimmerError(
        "player memory needs apsw and sqlite-vec (pip install apsw sqlite-vec): the standard sqlite3 "
        "module of this Python cannot load SQLite extensions"
    ) from exc


def connect(path: Path, factory: type[apsw.Connection] = apsw.Connection) -> apsw.Connection:
    """Open (or create) a store: sqlite-vec loaded, WAL, synchronous=FULL, foreign keys on.
    ``factory`` makes the connection (a subclass, e.g. the clasp's in-memory store at ":memory:")."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = factory(str(path))
    try:
        db.enable_load_extension(True)
        db.load_extension(sqlite_vec.loadable_path())
        db.enable_load_extension(False)
    except apsw.Error as exc:
        raise NimmerError(f"cannot load sqlite-vec into {path}: {exc}") from exc
    db.setbusytimeout(5000)  # first: a second process opening the store at once waits, even for WAL
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA foreign_keys=ON")
    return db


def migrate(db: apsw.Connection, migrations: Sequence[str], path: Path) -> int:
    """Apply the migrations this store has not seen yet, each in its own transaction.

    ``migrations[i]`` moves the schema from version i to i + 1. A store newer than this code is
    refused rather than touched.
    """
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version > len(migrations):
        raise NimmerError(
            f"{path} has schema version {version}, newer than this code knows "
            f"({len(migrations)}); upgrade nimmer-train"
        )
    for target in range(version + 1, len(migrations) + 1):
        with db:
            db.execute(migrations[target - 1])
            db.execute(f"PRAGMA user_version={target}")
    return len(migrations)


def integrity_ok(db: apsw.Connection) -> bool:
    try:
        return db.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
    except apsw.Error:
        return False


def set_meta(db: apsw.Connection, key: str, value: object) -> None:
    """One JSON value in a store's ``memory_meta`` table (migration marks, last runs)."""
    db.execute("INSERT OR REPLACE INTO memory_meta VALUES (?, ?)", (key, json.dumps(value)))


def get_meta(db: apsw.Connection, key: str, default: object = None) -> object:
    row = db.execute("SELECT value FROM memory_meta WHERE key = ?", (key,)).fetchone()
    return json.loads(row[0]) if row else default
