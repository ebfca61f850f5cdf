"""Artifacts on disk: content hashes, input fingerprints, atomic publication, manifests.

Every stage output is a folder named by a fingerprint of its inputs and config. It is built in a
hidden staging folder beside its final place, fsynced, and renamed into place, so a half-written
artifact is never visible. Its ``manifest.json`` lists the sha256 and size of every file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

MANIFEST = "manifest.json"
README = "README.md"  # an artifact's card: the data card of a dataset, the model card of a version
REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout: conf/, data_cards/, its git commit


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(obj: Any) -> str:
    """Full sha256 of a JSON-serialisable object (keys sorted); stable across runs."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def source_fingerprint(*modules: ModuleType) -> str:
    """sha256 over the source files of ``modules``: a code change renames the artifacts it makes."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()


def git_commit(cwd: Path | None = REPO_ROOT) -> str:
    """The current commit, with ``-dirty`` when the work tree has changes; ``unknown`` outside git."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return f"{commit}-dirty" if dirty else commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(path)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a staging folder; on success fsync it and rename it to ``final`` in one step.

    On failure the staging folder is removed and ``final`` is untouched.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_bytes_atomic(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` through a temp file, fsync, rename and fsync the folder;
    ``private``: readable by the owner only (0600 from the first byte). A failed write leaves
    ``path`` as it was and no temp file behind (a killed one leaves ``.NAME.tmp-PID``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any, private: bool = False) -> None:
    """Write JSON to ``path`` atomically (:func:`write_bytes_atomic`)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    write_bytes_atomic(path, text.encode(), private)


def file_table(folder: Path) -> list[dict[str, Any]]:
    """sha256 and size of every file under ``folder`` except the manifest, sorted by path."""
    rows = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        rows.append(
            {
                "path": path.relative_to(folder).as_posix(),
                "sha256": sha256_file(path),
                "size": path.stat().st_size,
            }
        )
    return rows


def write_manifest(folder: Path, kind: str, fingerprint_: str, lineage: dict[str, Any]) -> dict:
    """Write ``manifest.json`` for a finished artifact folder and return it."""
    manifest = {
        "kind": kind,
        "fingerprint": fingerprint_,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "lineage": lineage,
        "files": file_table(folder),
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST).read_text())


def intact_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a published folder whose files all match it, else None."""
    if (folder / MANIFEST).exists() and not verify_manifest(folder):
        return read_manifest(folder)
    return None


def verify_manifest(folder: Path) -> list[str]:
    """Files whose bytes no longer match the manifest (empty when the folder is intact)."""
    expected = {row["path"]: row["sha256"] for row in read_manifest(folder)["files"]}
    actual = {row["path"]: row["sha256"] for row in file_table(folder)}
    return sorted(p for p in expected.keys() | actual.keys() if expected.get(p) != actual.get(p))
