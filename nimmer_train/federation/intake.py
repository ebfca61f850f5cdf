"""The operator's A.2 intake as files (the service is ``intake_service.py``): anonymised uploads a
device wrote (``nimmer contributions upload``) are added to the pool (``nimmer federation a2
add``), and a device's deletion request is applied to it (``nimmer federation a2 forget``),
with an answer file for the device.

Deletion is forward-only (issue 6): the pool drops the uploads, refuses them if they arrive
later, and never trains on them again; what a released adapter already learned stays.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.errors import NimmerError
from nimmer_train.memory.deletion_requests import ANSWER_FORMAT, REQUEST_FORMAT, read_document
from nimmer_train.privacy.a2_pool import A2Pool
from nimmer_train.privacy.anonymize import Upload

UPLOAD_FORMAT = "nimmer-a2-upload/1"
DAY = 86400.0
STORE_FILE = "intake.sqlite"  # the intake service's store (its stage), beside the pool by default


def write_upload(upload: Upload, folder: Path) -> Path:
    """The upload as a file for the intake: its random id and its anonymised examples only."""
    path = folder / f"a2-upload-{upload.upload_id}.json"
    write_json_atomic(
        path, {"format": UPLOAD_FORMAT, "upload_id": upload.upload_id, "examples": list(upload.examples)}
    )
    return path


def add_uploads(pool_path: Path, files: list[Path], k: int) -> tuple[list[str], list[str]]:
    """Pool every upload file; returns (pooled ids, forgotten ids). An upload its player asked
    forgotten is never pooled again: it is refused and its file deleted (the intake keeps no
    copy of forgotten data), and the other files are still pooled."""
    uploads = []
    for path in files:
        data = read_document(path, UPLOAD_FORMAT)
        if not isinstance(data.get("examples"), list) or not data.get("upload_id"):
            raise NimmerError(f"{path}: an upload needs upload_id and a list of examples")
        uploads.append((path, Upload(str(data["upload_id"]), tuple(data["examples"]))))
    pool = A2Pool(pool_path, k)
    pooled, forgotten = [], []
    try:
        for path, upload in uploads:
            if _forgotten(pool, upload.upload_id):
                forgotten.append(upload.upload_id)
                path.unlink(missing_ok=True)
                continue
            pool.add(upload, now=time.time() // DAY * DAY)  # to the day, as the service's
            pooled.append(upload.upload_id)
    finally:
        pool.close()
    return pooled, forgotten


def _forgotten(pool: A2Pool, upload_id: str) -> bool:
    return pool.db.execute("SELECT 1 FROM deletions WHERE upload_id = ?", (upload_id,)).fetchone() is not None


def apply_deletion_request(pool_path: Path, request_file: Path, k: int) -> dict[str, Any]:
    """Forget the request's uploads in the pool; the answer for the device (which ids were
    dropped from the pool, which were not in it and are now refused should they arrive)."""
    request = read_document(request_file, REQUEST_FORMAT)
    ids = request.get("upload_ids")
    if not isinstance(ids, list) or not all(isinstance(i, str) and i for i in ids):
        raise NimmerError(f"{request_file}: upload_ids must be a list of upload ids")
    if not pool_path.exists():
        raise NimmerError(f"no A.2 pool at {pool_path}; name the pool the federation's a2-pool is")
    return forget_uploads(pool_path, ids, k, pool_path.parent / STORE_FILE)


def _unstage(store: Path, ids: list[str]) -> set[str]:
    """Drop ``ids`` from an intake service's stage (``store``, if one is there); the ids it held."""
    if not store.exists():
        return set()
    db = sqlite3.connect(store, isolation_level=None, timeout=30)
    try:
        db.execute("PRAGMA secure_delete = ON")
        if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'staged'").fetchone():
            return set()
        marks = ",".join("?" * len(ids))
        staged = {r[0] for r in db.execute(f"SELECT upload_id FROM staged WHERE upload_id IN ({marks})", ids)}
        db.execute(f"DELETE FROM staged WHERE upload_id IN ({marks})", ids)
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return staged
    finally:
        db.close()


def forget_uploads(pool_path: Path, ids: list[str], k: int, store: Path | None = None) -> dict[str, Any]:
    """Forward-only deletion of ``ids`` in the pool (created if missing, so that the ids are
    refused should they arrive later) and in the intake service's stage (``store``, when there
    is one); the answer for the device. One transaction for the pool, dates to the day."""
    day = time.time() // DAY * DAY
    pool = A2Pool(pool_path, k)
    try:
        # freed pages are zeroed and the WAL emptied: the forgotten text stays in no byte of the
        # pool's files (SQLite builds differ in their secure_delete default)
        pool.db.execute("PRAGMA secure_delete = ON")
        live = {
            r[0]
            for r in pool.db.execute(
                f"SELECT upload_id FROM uploads WHERE upload_id IN ({','.join('?' * len(ids))})", ids
            )
        }
        pool.db.execute("BEGIN IMMEDIATE")  # the service's release may write the pool meanwhile
        pool.db.executemany("INSERT OR IGNORE INTO deletions VALUES (?, ?)", [(i, day) for i in ids])
        pool.db.executemany("DELETE FROM uploads WHERE upload_id = ?", [(i,) for i in ids])
        pool.db.execute("COMMIT")
        pool.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    finally:
        pool.close()
    live |= _unstage(store, ids) if store is not None else set()
    return {
        "format": ANSWER_FORMAT,
        "dropped": sorted(live),
        "blocked": sorted(set(ids) - live),
        "answered_at": time.time(),
    }


def pooled_ids(pool_path: Path, k: int) -> list[str]:
    """The ids of the live uploads (the operator's own view; never published)."""
    pool = A2Pool(pool_path, k)
    try:
        return [r[0] for r in pool.db.execute("SELECT upload_id FROM uploads ORDER BY upload_id")]
    finally:
        pool.close()
