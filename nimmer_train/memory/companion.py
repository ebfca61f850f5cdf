"""companion.sqlite: audited premium-net intimate sessions (companion and sex-worker vocations).

Reads go through :func:`audited_read`, which logs who read and why; the manual prune API
:func:`decide` records every keep/delete decision in decision_log in the same transaction as
the change itself.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import apsw

from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import connect, migrate

COMPANION_FILE = "companion.sqlite"
GOODS_TYPES = ("companion_session", "sex_worker_session")
MIGRATIONS = (
    f"""
    CREATE TABLE sessions (
        id INTEGER PRIMARY KEY,
        npc TEXT NOT NULL,
        goods_type TEXT NOT NULL CHECK (goods_type IN {GOODS_TYPES}),
        started_at REAL NOT NULL,
        ended_at REAL,
        summary TEXT NOT NULL
    );
    CREATE TABLE decision_log (
        id INTEGER PRIMARY KEY,
        at REAL NOT NULL,
        actor TEXT NOT NULL,
        action TEXT NOT NULL CHECK (action IN ('read', 'keep', 'delete')),
        session_id INTEGER,
        reason TEXT NOT NULL
    );
    """,
)


@dataclass(frozen=True)
class Session:
    id: int
    npc: str
    goods_type: str
    started_at: float
    ended_at: float | None
    summary: str


def open_companion(folder: Path) -> apsw.Connection:
    path = folder / COMPANION_FILE
    db = connect(path)
    migrate(db, MIGRATIONS, path)
    return db


def record_session(
    db: apsw.Connection,
    npc: str,
    goods_type: str,
    summary: str,
    started_at: float,
    ended_at: float | None = None,
) -> int:
    if goods_type not in GOODS_TYPES:
        raise NimmerError(f"goods_type {goods_type!r} is not one of {', '.join(GOODS_TYPES)}")
    with db:
        db.execute(
            "INSERT INTO sessions (npc, goods_type, started_at, ended_at, summary) VALUES (?, ?, ?, ?, ?)",
            (npc, goods_type, started_at, ended_at, summary),
        )
        return db.last_insert_rowid()


def audited_read(db: apsw.Connection, actor: str, reason: str, now: float | None = None) -> list[Session]:
    """Every session, with the read itself logged (actor and reason are required)."""
    if not actor.strip() or not reason.strip():
        raise NimmerError("an audited read needs an actor and a reason")
    with db:
        db.execute(
            "INSERT INTO decision_log (at, actor, action, session_id, reason) VALUES (?, ?, 'read', NULL, ?)",
            (now if now is not None else time.time(), actor, reason),
        )
        rows = db.execute(
            "SELECT id, npc, goods_type, started_at, ended_at, summary FROM sessions ORDER BY id"
        ).fetchall()
    return [Session(*row) for row in rows]


def decide(
    db: apsw.Connection, session_id: int, action: str, actor: str, reason: str, now: float | None = None
) -> None:
    """The player's manual prune: keep or delete one session, logged in the same transaction."""
    if action not in ("keep", "delete"):
        raise NimmerError(f"action must be keep or delete, got {action!r}")
    with db:
        if not db.execute("SELECT 1 FROM sessions WHERE id = ?", (session_id,)).fetchone():
            raise NimmerError(f"no companion session {session_id}")
        if action == "delete":
            db.execute("DELETE FROM sessions WHERE id = ?", (session_id,))
        db.execute(
            "INSERT INTO decision_log (at, actor, action, session_id, reason) VALUES (?, ?, ?, ?, ?)",
            (now if now is not None else time.time(), actor, action, session_id, reason),
        )


def decision_log(db: apsw.Connection) -> list[tuple]:
    return db.execute("SELECT at, actor, action, session_id, reason FROM decision_log ORDER BY id").fetchall()
