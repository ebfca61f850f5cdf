"""The server's A.2 intake: anonymised uploads pooled in SQLite, trained on only once at least
k are pooled, with forward-only deletion (a deleted upload is left out of every later training
read; what was already trained on stays trained).

The pool's counts leave the server only through :func:`noised_counts`: the Gaussian mechanism on
(uploads, examples per data category), accounted in the A.2 record-level ledger. Beside the pool
lies its claim key (:func:`claim_key`), with which the server-operated A.2 node tags the DP-SGD
step it reports, so that the server accounts no other node's claim."""

from __future__ import annotations

import contextlib
import json
import math
import secrets
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from nimmer_train.artifacts import write_secret
from nimmer_train.errors import NimmerError
from nimmer_train.privacy.anonymize import Upload

SCHEMA = """
CREATE TABLE IF NOT EXISTS uploads (
    upload_id TEXT PRIMARY KEY, received_at REAL NOT NULL, examples TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS deletions (
    upload_id TEXT PRIMARY KEY, requested_at REAL NOT NULL
) WITHOUT ROWID;  -- no row order: nothing tells which ids arrived together
"""


class PoolTooSmall(NimmerError):
    """Fewer than k live uploads: the intake refuses to train."""


class A2Pool:
    def __init__(self, path: Path, k: int) -> None:
        if k < 1:
            raise NimmerError("the A.2 pool threshold k must be >= 1")
        path.parent.mkdir(parents=True, exist_ok=True)
        self.k = k
        self.db = sqlite3.connect(path, isolation_level=None)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.executescript(SCHEMA)

    def add(self, upload: Upload, now: float | None = None) -> None:
        """Pool an upload; a deleted id cannot come back."""
        if self.db.execute("SELECT 1 FROM deletions WHERE upload_id = ?", (upload.upload_id,)).fetchone():
            raise NimmerError(f"upload {upload.upload_id} was deleted; it cannot be pooled again")
        self.db.execute(
            "INSERT OR IGNORE INTO uploads VALUES (?, ?, ?)",
            (upload.upload_id, now if now is not None else time.time(), json.dumps(upload.examples)),
        )

    def delete(self, upload_id: str, now: float | None = None) -> None:
        """Forward-only deletion: the upload's examples leave the pool for all future training."""
        with self.db:
            self.db.execute("BEGIN")
            self.db.execute(
                "INSERT OR IGNORE INTO deletions VALUES (?, ?)",
                (upload_id, now if now is not None else time.time()),
            )
            self.db.execute("DELETE FROM uploads WHERE upload_id = ?", (upload_id,))

    def live(self) -> int:
        return self.db.execute("SELECT COUNT(*) FROM uploads").fetchone()[0]

    def training_examples(self) -> list[dict[str, str]]:
        """Every live example, or PoolTooSmall while fewer than k uploads are pooled."""
        count = self.live()
        if count < self.k:
            # no count: the message reaches the A.2 node's log, and no epsilon covers an exact one
            raise PoolTooSmall(f"the A.2 pool holds fewer than k={self.k} uploads; it trains nothing yet")
        rows = self.db.execute("SELECT examples FROM uploads ORDER BY upload_id").fetchall()
        return [example for (blob,) in rows for example in json.loads(blob)]

    def summary(self) -> dict:
        """Counts only: live uploads, trainable examples (0 below k) and examples per data category."""
        live = self.live()
        rows = self.training_examples() if live >= self.k else []
        counts = Counter(str(r.get("data_category", "unknown")) for r in rows)
        return {"uploads": live, "examples": len(rows), "categories": dict(sorted(counts.items()))}

    def counts(self) -> dict:
        """Exact counts over every live upload, whatever k (for :func:`noised_counts` only: a
        count that appears only above k would jump by a whole pool for one record)."""
        rows = self.db.execute("SELECT examples FROM uploads").fetchall()
        examples = [e for (blob,) in rows for e in json.loads(blob)]
        counts = Counter(str(e.get("data_category", "unknown")) for e in examples)
        return {"uploads": len(rows), "categories": dict(counts)}

    def close(self) -> None:
        self.db.close()


def pool_summary(path: Path | None, k: int) -> dict:
    """:meth:`A2Pool.summary` of the pool at ``path`` (an empty summary when there is none)."""
    if path is None or not path.exists():
        return {"uploads": 0, "examples": 0, "categories": {}}
    pool = A2Pool(path, k)
    try:
        return pool.summary()
    finally:
        pool.close()


# One record (one pooled example) moves its upload count by at most 1 (when it is the only
# example of its upload) and one category count by 1: L2 sensitivity sqrt(2).
COUNT_SENSITIVITY = math.sqrt(2)


def noised_counts(
    path: Path | None, k: int, categories: Iterable[str], noise_multiplier: float, rng: np.random.Generator
) -> dict:
    """The pool's upload count and per-category example counts with Gaussian noise of std
    ``noise_multiplier * sqrt(2)`` on each figure: one Gaussian mechanism of noise multiplier
    ``noise_multiplier`` (account it as the step (noise_multiplier, 1.0, 1)). Every category in
    ``categories`` is released (zero ones too: which categories appear is itself a count), plus
    ``unknown`` for examples without one. ``rng`` must be seeded from the OS's entropy."""
    exact = {"uploads": 0, "categories": {}}
    if path is not None and path.exists():
        pool = A2Pool(path, k)
        try:
            exact = pool.counts()
        finally:
            pool.close()
    std = noise_multiplier * COUNT_SENSITIVITY
    names = [*dict.fromkeys([*categories, "unknown"])]
    noisy = {c: float(exact["categories"].get(c, 0) + rng.normal(0.0, std)) for c in names}
    unlisted = set(exact["categories"]) - set(names)
    if unlisted:  # a category outside the public list would leak by its name: count it as unknown
        noisy["unknown"] += sum(exact["categories"][c] for c in unlisted)
    return {
        "uploads": float(exact["uploads"] + rng.normal(0.0, std)),
        "categories": noisy,
        "noise_std": std,
        "noise_multiplier": noise_multiplier,
    }


CLAIM_KEY_BYTES = 32  # of entropy; the file holds them hex-encoded


def claim_key_path(pool: Path) -> Path:
    return pool.with_name(f"{pool.name}.claim-key")


def claim_key(pool: Path, create: bool = False) -> bytes:
    """The secret the A.2 node tags its accounting claims with (``wire.a2_claim``), kept beside
    the pool (mode 0600). The server creates it (``create``) when it starts with the pool; the
    A.2 node only reads it, so an A.2 node whose pool no server knows trains nothing it could not
    account. NimmerError naming the file when it is missing or too short."""
    path = claim_key_path(pool)
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process wrote it in between: theirs is it
            write_secret(path, secrets.token_hex(CLAIM_KEY_BYTES).encode())
    try:
        key = path.read_bytes().strip()
    except FileNotFoundError:
        raise NimmerError(
            f"no A.2 claim key at {path}: the federation server writes it when it starts with this pool "
            "(run config a2-pool); start the server with the pool before the A.2 node trains"
        ) from None
    if len(key) < 2 * CLAIM_KEY_BYTES:
        raise NimmerError(
            f"the A.2 claim key {path} is shorter than {2 * CLAIM_KEY_BYTES} characters: delete it and "
            "restart the federation server with the pool, which writes a new one"
        )
    return key
