"""``nimmer versions pull <url-or-path>``: bring a published version onto this device.

The source is a version folder as the publisher's ``blob_distribution`` lays it out
(``<base_url>/nimmerworld-base-vN/``, over http(s) or a local path); the register LoRAs it lists
come from ``<base_url>/loras/<lora_id>/`` beside it. The signed manifest is fetched and its
signature checked against the trusted keys before anything else is downloaded; then every file
(never more bytes than its signed size) into ``releases/.pulls/<label>-<manifest sha>/``. A pull
that stops (killed, a dropped connection) leaves its partial files there and the next pull of the
same version continues them (HTTP ``Range``, or a seek for a local path). Only after the whole
folder verifies (signature, every file's sha256, nothing extra, no symlink) and every LoRA's
files match is it renamed into ``releases/`` and its registry rows committed, under the
registry's write lock: a version that fails verification is never visible. A file whose bytes do
not match is deleted from the staging folder, so the next pull fetches it afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sqlite3
import stat
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from nimmer_train.artifacts import MANIFEST, sha256_file
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.publish.manifest import (
    FORMAT,
    SIGNATURE,
    IntegrityError,
    check_files,
    safe_relative,
    verify_folder,
)
from nimmer_train.publish.registry import PREFIX, REGISTRY_FILE, Registry
from nimmer_train.publish.signing import Keyring

PULLS = ".pulls"  # releases/.pulls/<label>-<manifest sha[:16]>/: pulls in progress, kept across kills
MAX_MANIFEST_BYTES = 16 << 20  # a manifest or signature larger than this is refused unread
CHUNK = 1 << 20


class PullError(NimmerError):
    """A pull that could not fetch a file (unreachable source, HTTP error, dropped connection)."""


@dataclass(frozen=True)
class PullResult:
    label: str
    key_id: str
    files: int  # version files and LoRA files checked
    fetched_bytes: int  # transferred by this pull
    resumed_bytes: int  # already on disk from an interrupted pull, continued, not fetched again
    already: bool  # the version was registered here before this pull
    alias: str | None
    seconds: float


class Source:
    """A version folder to pull from (http(s) URL, file:// URL or local path) and the releases
    root beside it (its parent), where its LoRAs live."""

    def __init__(self, location: str, client: httpx.Client | None = None, timeout_s: float = 60.0) -> None:
        location = location.rstrip("/")
        if location.endswith(f"/{MANIFEST}"):
            location = location[: -len(MANIFEST) - 1]
        self.location = location
        self.http = location.startswith(("http://", "https://"))
        if self.http:
            self.client = client or httpx.Client(timeout=timeout_s, follow_redirects=True)
            self.root = location.rsplit("/", 1)[0]
        else:
            folder = Path(location.removeprefix("file://")).expanduser()
            if not folder.is_dir():
                raise PullError(
                    f"pull source {location}: no such folder; give a version folder "
                    f"(.../releases/{PREFIX}N) or its http(s) URL"
                )
            self.folder, self.root = folder, str(folder.parent)

    def where(self, rel: str, lora: bool = False) -> str:
        """The address of ``rel`` (relative to the version folder, or to the root for a LoRA)."""
        base = self.root if lora else self.location if self.http else str(self.folder)
        return f"{base}/{rel}"

    def read(self, rel: str) -> bytes:
        """A small file of the version folder (manifest, signature), capped in size."""
        where = self.where(rel)
        if not self.http:
            path = Path(where)
            if path.is_symlink() or not path.is_file():
                raise PullError(
                    f"{where}: missing or not a regular file; is {self.location} a version folder?"
                )
            if path.stat().st_size > MAX_MANIFEST_BYTES:
                raise IntegrityError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes; refused")
            return path.read_bytes()
        try:
            with self.client.stream("GET", where) as reply:
                if reply.status_code != 200:
                    raise PullError(
                        f"GET {where}: HTTP {reply.status_code}; is {self.location} a version URL?"
                    )
                body = b""
                for chunk in reply.iter_bytes():
                    body += chunk
                    if len(body) > MAX_MANIFEST_BYTES:
                        raise IntegrityError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes; refused")
                return body
        except httpx.HTTPError as exc:
            raise PullError(
                f"GET {where} failed ({type(exc).__name__}: {exc}); check the URL and retry"
            ) from exc

    def fetch(self, where: str, target: Path, size: int) -> tuple[int, int]:
        """Bring ``target`` up to ``size`` bytes from ``where``, continuing what is there;
        (bytes fetched, bytes resumed). Never writes past ``size``."""
        have = target.stat().st_size if target.is_file() else 0
        if have > size:
            target.unlink()
            have = 0
        if have == size:
            return 0, have
        target.parent.mkdir(parents=True, exist_ok=True)
        return (self._fetch_http if self.http else self._fetch_path)(where, target, size, have)

    def _fetch_path(self, where: str, target: Path, size: int, have: int) -> tuple[int, int]:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        try:
            fd = os.open(where, flags)
        except OSError as exc:
            raise PullError(f"{where} cannot be opened ({exc}); the source folder is incomplete") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IntegrityError(f"{where} is not a regular file; refused")
        fetched = 0
        with os.fdopen(fd, "rb") as src, open(target, "ab") as out:
            src.seek(have)
            while have + fetched < size and (chunk := src.read(min(CHUNK, size - have - fetched))):
                out.write(chunk)
                fetched += len(chunk)
        if have + fetched != size:
            raise IntegrityError(f"{where} holds {have + fetched} bytes, its signed size is {size}")
        return fetched, have

    def _fetch_http(self, where: str, target: Path, size: int, have: int) -> tuple[int, int]:
        headers = {"Range": f"bytes={have}-"} if have else {}
        fetched = 0
        try:
            with self.client.stream("GET", where, headers=headers) as reply:
                if reply.status_code == 200:  # the server ignored the Range: start over
                    have, mode = 0, "wb"
                elif reply.status_code == 206 and reply.headers.get("content-range", "").startswith(
                    f"bytes {have}-"
                ):
                    mode = "ab"
                else:  # a partial the source no longer matches (416, another range): start over
                    target.unlink(missing_ok=True)
                    raise PullError(
                        f"GET {where} (from byte {have}): HTTP {reply.status_code}; the partial file "
                        "was discarded, run the same pull again"
                    )
                with open(target, mode) as out:
                    for chunk in reply.iter_bytes(CHUNK):
                        if have + fetched + len(chunk) > size:
                            raise IntegrityError(
                                f"{where} sends more than its signed size of {size} bytes; refused"
                            )
                        out.write(chunk)
                        fetched += len(chunk)
        except httpx.HTTPError as exc:
            raise PullError(
                f"GET {where} stopped after {have + fetched} of {size} bytes ({type(exc).__name__}: "
                f"{exc}); run the same pull again: it continues from there"
            ) from exc
        if have + fetched != size:
            raise PullError(
                f"GET {where} ended after {have + fetched} of {size} bytes; run the same pull again"
            )
        return fetched, have


def _label(manifest: dict[str, Any]) -> tuple[str, int]:
    label = manifest.get("version_label")
    match = re.fullmatch(rf"{PREFIX}(\d+)", label) if isinstance(label, str) else None
    if manifest.get("format") != FORMAT or match is None:
        raise IntegrityError(
            f"signed manifest has format {manifest.get('format')!r} and label {label!r}; "
            f"expected {FORMAT} and {PREFIX}N"
        )
    return label, int(match.group(1))


def _fetch_checked(
    source: Source, where: str, target: Path, row: dict[str, Any], what: str
) -> tuple[int, int]:
    """One file fetched (continued) and checked against its signed sha256; a mismatch deletes it."""
    fetched, resumed = source.fetch(where, target, int(row["size"]))
    if sha256_file(target) != row["sha256"]:
        target.unlink()
        raise IntegrityError(
            f"{what}: file {row['path']} from {where} does not match its signed sha256 "
            f"({row['sha256'][:12]}...); it was discarded and nothing was registered; pull again, "
            "or from another mirror if it fails again"
        )
    return fetched, resumed


def _lora_folder(entry: dict[str, Any], label: str) -> str:
    rel = safe_relative(entry.get("path"), f"{label}: LoRA {entry.get('lora_id')}")
    if not re.fullmatch(r"loras/[^/]+", rel) or rel != f"loras/{entry.get('lora_id')}":
        raise IntegrityError(f"{label}: LoRA path {rel!r} is not loras/<lora_id>; refused")
    return rel


def _existing(releases: Path, manifest: dict[str, Any], label: str, number: int) -> bool:
    """True when this very version is registered here; NimmerError if another holds its number."""
    if not (releases / REGISTRY_FILE).exists():
        return False
    registry = Registry.open(releases)
    try:
        row = registry.db.execute(
            "SELECT version_id FROM base_model_versions WHERE version_number = ?", (number,)
        ).fetchone()
    finally:
        registry.close()
    if row is None:
        return False
    if row[0] != manifest["version_id"]:
        raise NimmerError(
            f"{releases / REGISTRY_FILE} already holds {label} with version id {row[0]}, the pulled "
            f"one is {manifest['version_id']}: they are different versions (another publisher?); "
            "pull into another releases folder"
        )
    return True


def pull_version(
    releases: Path,
    location: str,
    keyring: Keyring,
    alias: str | None = "production",
    client: httpx.Client | None = None,
) -> PullResult:
    """Pull the version at ``location`` into ``releases`` (see the module docstring) and point
    ``alias`` at it; the same version pulled again only moves the alias."""
    started = time.perf_counter()
    source = Source(location, client)
    try:
        return _pull(releases, source, keyring, alias, started)
    finally:
        if client is None and source.http:
            source.client.close()


def _pull(releases: Path, source: Source, keyring: Keyring, alias: str | None, started: float) -> PullResult:
    raw = source.read(MANIFEST)
    sig_raw = source.read(SIGNATURE)
    try:
        signature = json.loads(sig_raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{source.where(SIGNATURE)} is not readable JSON ({exc})") from exc
    key_id = keyring.verify(raw, signature, source.where(MANIFEST))  # before any other byte
    manifest = json.loads(raw)
    label, number = _label(manifest)
    files = manifest["blob_distribution"]["files"]
    loras = [c for c in manifest.get("compatible_loras", []) if isinstance(c, dict)]
    if _existing(releases, manifest, label, number):
        _set_alias(releases, label, alias)
        return PullResult(label, key_id, 0, 0, 0, True, alias, time.perf_counter() - started)

    digest = hashlib.sha256(raw).hexdigest()
    work = releases / PULLS / f"{label}-{digest[:16]}"
    staged = work / "version"
    staged.mkdir(parents=True, exist_ok=True)
    (staged / MANIFEST).write_bytes(raw)
    (staged / SIGNATURE).write_bytes(sig_raw)
    fetched = resumed = count = 0
    for row in files:
        rel = safe_relative(row["path"], label)
        if rel in (MANIFEST, SIGNATURE):
            raise IntegrityError(f"{label}: the manifest lists {rel} as a blob; refused")
        got, had = _fetch_checked(source, source.where(rel), staged / rel, row, label)
        fetched, resumed, count = fetched + got, resumed + had, count + 1
    new_loras: dict[str, Path] = {}
    for entry in loras:
        rel = _lora_folder(entry, label)
        if (releases / rel).is_dir() and _lora_registered(releases, entry["lora_id"]):
            check_files(releases / rel, entry["files"], f"LoRA {entry['lora_id']} (already here)")
            continue
        folder = work / rel
        for row in entry["files"]:
            path = safe_relative(row["path"], f"LoRA {entry['lora_id']}")
            where = source.where(f"{rel}/{path}", lora=True)
            got, had = _fetch_checked(source, where, folder / path, row, f"LoRA {entry['lora_id']}")
            fetched, resumed, count = fetched + got, resumed + had, count + 1
        check_files(folder, entry["files"], f"LoRA {entry['lora_id']}")
        new_loras[entry["lora_id"]] = folder

    # the same check every reader runs, on the staged folder, before it can be seen
    verified = verify_folder(staged, keyring)
    if (staged / MANIFEST).read_bytes() != raw or verified.get("version_id") != manifest["version_id"]:
        raise IntegrityError(f"{label}: the staged manifest changed while pulling; pull again")
    _commit(releases, staged, manifest, digest, key_id, loras, new_loras, alias)
    for stale in (releases / PULLS).glob(f"{label}-*"):  # this pull's, and older attempts' at it
        shutil.rmtree(stale, ignore_errors=True)
    return PullResult(label, key_id, count, fetched, resumed, False, alias, time.perf_counter() - started)


def _lora_registered(releases: Path, lora_id: str) -> bool:
    if not (releases / REGISTRY_FILE).exists():
        return False
    registry = Registry.open(releases)
    try:
        return registry.lora(lora_id) is not None
    finally:
        registry.close()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit(
    releases: Path,
    staged: Path,
    manifest: dict[str, Any],
    digest: str,
    key_id: str,
    loras: list[dict[str, Any]],
    new_loras: dict[str, Path],
    alias: str | None,
) -> None:
    """Under the registry's write lock: rename the verified folders into place, insert the rows
    (publish's own row format), move the alias; a kill before the commit leaves folders without
    rows, which the next publish or pull removes."""
    from nimmer_train.artifacts import _fsync_tree
    from nimmer_train.publish.release import _insert

    label = manifest["version_label"]
    for folder in [staged, *new_loras.values()]:
        _fsync_tree(folder)
    registry = Registry.open(releases, create=True)
    try:
        with registry.writing():
            registry.remove_leftovers()
            known = {v.label: v.id for v in registry.versions()}
            if manifest["version_id"] in known.values():  # another pull won the lock first
                return
            registered = {k for k in new_loras if registry.lora(k) is not None}  # by a pull meanwhile
            rows = [
                {
                    **{k: entry[k] for k in ("lora_id", "register", "fingerprint", "path", "files")},
                    # from the LoRA's metadata, one of its signed (and checked) files
                    "trained_on_weights_sha256": read_metadata(new_loras[entry["lora_id"]])["base"][
                        "weights_sha256"
                    ],
                    "new": True,
                }
                for entry in loras
                if entry["lora_id"] in new_loras and entry["lora_id"] not in registered
            ]
            parent = manifest.get("parent_version")
            try:  # the rows first: they commit only after the folders are in place
                _insert(
                    registry,
                    label,
                    {
                        "manifest": manifest,
                        "manifest_sha256": digest,
                        "key_id": key_id,
                        "parent": known.get(parent) if parent else None,  # None: not pulled here
                        "loras": rows,
                        "compat": loras,
                    },
                )
            except sqlite3.IntegrityError as exc:
                raise NimmerError(
                    f"{label} cannot be registered in {releases / REGISTRY_FILE} ({exc}): it clashes "
                    "with a version already there; pull into another releases folder"
                ) from exc
            os.replace(staged, releases / label)
            for lora_id, folder in new_loras.items():
                (releases / "loras").mkdir(exist_ok=True)
                if not (releases / "loras" / lora_id).exists():  # its row's folder gone: put it back
                    os.replace(folder, releases / "loras" / lora_id)
            _fsync_dir(releases)
            if alias:
                registry.set_alias(alias, registry.find(label), _now())
    finally:
        registry.close()


def _set_alias(releases: Path, label: str, alias: str | None) -> None:
    if not alias:
        return
    registry = Registry.open(releases)
    try:
        with registry.writing():
            registry.set_alias(alias, registry.find(label), _now())
    finally:
        registry.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
