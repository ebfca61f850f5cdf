"""A durable on-disk cache of teacher responses (SQLite, WAL, fsync on commit).

Keyed by backend, model, request and sampling (the request key covers the last two). A reply
is stored before it is used, so a killed run resumes without paying for anything twice.
Failed attempts (timeouts, exhausted retries) are not stored: the next run asks again.
"""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

from nimmer_train.artifacts import fingerprint
from nimmer_train.synth.teacher.base import TeacherReply

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    backend TEXT NOT NULL,
    model TEXT NOT NULL,
    request_key TEXT NOT NULL,
    content TEXT,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    dropped_knobs TEXT NOT NULL,
    created_at REAL NOT NULL
)
"""


class ResponseCache:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute(SCHEMA)

    @staticmethod
    def key(backend: str, model: str, request_key: str) -> str:
        return fingerprint({"backend": backend, "model": model, "request": request_key})

    def get(self, backend: str, model: str, request_key: str) -> TeacherReply | None:
        row = self.db.execute(
            "SELECT content, prompt_tokens, completion_tokens, latency_s, dropped_knobs "
            "FROM responses WHERE key = ?",
            (self.key(backend, model, request_key),),
        ).fetchone()
        if row is None:
            return None
        return TeacherReply(row[0], row[1], row[2], row[3], None, tuple(json.loads(row[4])))

    def put(self, backend: str, model: str, request_key: str, reply: TeacherReply) -> None:
        """Store a reply that arrived (successful or not, it was paid for)."""
        # autocommit + synchronous=FULL: durable on disk when execute() returns
        self.db.execute(
            "INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                self.key(backend, model, request_key),
                backend,
                model,
                request_key,
                reply.content,
                reply.prompt_tokens,
                reply.completion_tokens,
                reply.latency_s,
                json.dumps(list(reply.dropped_knobs)),
                time.time(),
            ),
        )

    def __len__(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        self.db.close()
