"""A version folder's signed manifest, and verifying a folder against it.

``manifest.json`` carries every field of the design's base_model_versions row plus the file table
(``blob_distribution.files``: path, sha256, size, location); ``manifest.sig`` holds the publisher's
Ed25519 signature over the manifest's exact bytes. Verification checks the signature against the
trusted keys first, then that the folder holds exactly the listed files with their sizes and sha256.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import MANIFEST, sha256_file
from nimmer_train.errors import NimmerError
from nimmer_train.publish.signing import Keyring, SignatureError

SIGNATURE = "manifest.sig"
FORMAT = "nimmerworld-base-version/1"


class IntegrityError(NimmerError):
    """A file of a version or LoRA that is missing, truncated, changed or unexpected."""


def release_files(folder: Path) -> list[dict[str, Any]]:
    """path, sha256 and size of every file in a version folder but the manifest and signature."""
    skip = {MANIFEST, SIGNATURE}
    return [
        {"path": p.relative_to(folder).as_posix(), "sha256": sha256_file(p), "size": p.stat().st_size}
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.relative_to(folder).as_posix() not in skip
    ]


def manifest_bytes(manifest: dict[str, Any]) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def safe_relative(rel: Any, what: str) -> str:
    """``rel`` if it is a plain relative POSIX path inside its folder (no absolute path, no ``..``,
    no backslash, no empty part); IntegrityError otherwise."""
    parts = rel.split("/") if isinstance(rel, str) else []
    if not parts or rel.startswith("/") or "\\" in rel or any(p in ("", ".", "..") for p in parts):
        raise IntegrityError(f"{what}: path {rel!r} is not a plain relative path inside its folder; refused")
    return rel


def refuse_symlinks(folder: Path, what: str) -> None:
    """IntegrityError naming the first symlink at or under ``folder`` (links are never followed)."""
    if folder.is_symlink():
        raise IntegrityError(f"{what}: {folder} is a symlink; a release folder must hold its own files")
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in sorted(dirs + files):
            if (Path(root) / name).is_symlink():
                rel = (Path(root) / name).relative_to(folder).as_posix()
                raise IntegrityError(f"{what}: {rel} in {folder} is a symlink; symlinks are refused")


def check_files(folder: Path, files: list[dict[str, Any]], what: str) -> None:
    """Every listed file present with its size and sha256, and nothing else, no symlink anywhere;
    raise naming the file."""
    refuse_symlinks(folder, what)
    listed = {safe_relative(row["path"], what) for row in files}
    for row in files:
        path = folder / row["path"]
        if not path.is_file():
            raise IntegrityError(f"{what}: file {row['path']} is missing from {folder}")
        size = path.stat().st_size
        if size != row["size"]:
            raise IntegrityError(
                f"{what}: file {row['path']} is {size} bytes, the manifest says {row['size']} "
                f"({'truncated' if size < row['size'] else 'grown'}); download it again"
            )
        if sha256_file(path) != row["sha256"]:
            raise IntegrityError(
                f"{what}: file {row['path']} does not match its sha256 in the manifest "
                f"({row['sha256'][:12]}...); the bytes changed; download it again"
            )
    extra = sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if not p.is_dir() and p.relative_to(folder).as_posix() not in listed | {MANIFEST, SIGNATURE}
    )
    if extra:
        raise IntegrityError(f"{what}: {folder} holds files the manifest does not list: {', '.join(extra)}")


def verify_folder(folder: Path, keyring: Keyring) -> dict[str, Any]:
    """The manifest of a version folder, after checking its signature and every file."""
    what = folder.name
    refuse_symlinks(folder, what)
    for name in (MANIFEST, SIGNATURE):
        if not (folder / name).is_file():
            raise IntegrityError(f"{what}: {name} is missing from {folder}")
    raw = (folder / MANIFEST).read_bytes()
    try:
        signature = json.loads((folder / SIGNATURE).read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SignatureError(f"{what}: {SIGNATURE} is not readable JSON ({exc})") from exc
    keyring.verify(raw, signature, f"{what}/{MANIFEST}")
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise IntegrityError(f"{what}: manifest format {manifest.get('format')!r}, expected {FORMAT}")
    check_files(folder, manifest["blob_distribution"]["files"], what)
    return manifest
