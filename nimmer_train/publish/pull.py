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

A mirror is not trusted beyond the signature: the signed label must be the one the source names,
a pull never moves an alias to an older version than it names now (``allow_downgrade`` to roll
back on purpose) and never moves ``candidate``; replies must not be content-encoded; redirects are
followed only within the source's origin (scheme, host and port), so a mirror cannot make the
device send a request anywhere else before the signature check; a manifest or signature that is
not JSON, or nested deeper than the parser goes, is an error naming the file. The staging
folder is the pull's own: a symlink in it is refused, files the manifest does not list are
deleted before fetching, and what was verified is checked unchanged under the lock before the
rename. A version already registered here is verified before its alias moves; one that fails is
fetched again and its folder replaced (a repair).

A mirror's releases folder (not one version's) is pulled by name through its signed index
(``publish/index.py``, :func:`pull_from_mirror`): ``newest``, an alias or ``vN`` resolves to a
label and the sha256 of its manifest; the index's signature is checked first; then an expired
index is refused (a frozen mirror; ``allow_expired`` for an offline copy), so is an index under
another ``index_id`` than the one this device pinned at its first mirror pull (whatever the
mirror: ``accept_index_id`` names a new one on purpose, and only an index under that id, issued
no earlier than the latest index this device read: naming an earlier releases folder's id rolls
nothing back), and one older than an index this device already read; the version's manifest must
hash to what the index names before anything else is fetched.
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
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from nimmer_train.artifacts import MANIFEST, NOFOLLOW, fsync_dir, fsync_tree, sha256_file
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.publish.index import (
    INDEX,
    ISSUED_SETTING,
    PIN_SETTING,
    SEEN_SETTING,
    expired,
    read_index,
    resolve,
)
from nimmer_train.publish.manifest import (
    FORMAT,
    SIGNATURE,
    IntegrityError,
    check_files,
    safe_relative,
    verify_folder,
)
from nimmer_train.publish.registry import PREFIX, REGISTRY_FILE, Registry
from nimmer_train.publish.release import _insert
from nimmer_train.publish.signing import Keyring, SignatureError
from nimmer_train.publish.versions import verify_version

PULLS = ".pulls"  # releases/.pulls/<label>-<manifest sha[:16]>/: pulls in progress, kept across kills
MAX_MANIFEST_BYTES = 16 << 20  # a manifest or signature larger than this is refused unread
CHUNK = 1 << 20
IDENTITY = {"Accept-Encoding": "identity"}  # bytes as signed: no decompression (no gzip bomb)
MAX_REDIRECTS = 5  # within the source's origin only


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
    repaired: bool = False  # registered here but failed verification: fetched again and replaced
    discarded: tuple[str, ...] = ()  # unlisted files found in the staging folder and deleted


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
            self.client = client or httpx.Client(timeout=timeout_s, follow_redirects=False)
            self.root, self.name = location.rsplit("/", 1)
        else:
            folder = Path(location.removeprefix("file://")).expanduser()
            if not folder.is_dir():
                raise PullError(
                    f"pull source {location}: no such folder; give a version folder "
                    f"(.../releases/{PREFIX}N) or its http(s) URL"
                )
            self.folder, self.root, self.name = folder, str(folder.parent), folder.name

    def where(self, rel: str, lora: bool = False) -> str:
        """The address of ``rel`` (relative to the version folder, or to the root for a LoRA)."""
        base = self.root if lora else self.location if self.http else str(self.folder)
        return f"{base}/{rel}"

    def read(self, rel: str, hint: str = "a version folder") -> bytes:
        """A small file of the version folder (manifest, signature) or of a mirror's root (its
        index), capped in size; ``hint``: what the location should be, for the error."""
        where = self.where(rel)
        if not self.http:
            path = Path(where)
            if path.is_symlink() or not path.is_file():
                raise PullError(f"{where}: missing or not a regular file; is {self.location} {hint}?")
            if path.stat().st_size > MAX_MANIFEST_BYTES:
                raise IntegrityError(f"{where} is larger than {MAX_MANIFEST_BYTES} bytes; refused")
            return path.read_bytes()
        try:
            with _get(self.client, where, IDENTITY) as reply:
                if reply.status_code != 200:
                    raise PullError(f"GET {where}: HTTP {reply.status_code}; is {self.location} {hint}?")
                _plain(reply, where)
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
        try:
            mode = os.lstat(target).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and not stat.S_ISREG(mode):
            raise IntegrityError(
                f"{target} is a symlink or not a regular file; a pull writes only plain files of its "
                f"own; remove {target.parent} and pull again"
            )
        have = target.stat().st_size if mode is not None else 0
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
        with os.fdopen(fd, "rb") as src, _open_staged(target, append=True) as out:
            src.seek(have)
            while have + fetched < size and (chunk := src.read(min(CHUNK, size - have - fetched))):
                out.write(chunk)
                fetched += len(chunk)
        if have + fetched != size:
            raise IntegrityError(f"{where} holds {have + fetched} bytes, its signed size is {size}")
        return fetched, have

    def _fetch_http(self, where: str, target: Path, size: int, have: int) -> tuple[int, int]:
        headers = {**IDENTITY, "Range": f"bytes={have}-"} if have else IDENTITY
        fetched = 0
        try:
            with _get(self.client, where, headers) as reply:
                _plain(reply, where)
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
                with _open_staged(target, append=mode == "ab") as out:
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


@contextmanager
def _get(client: httpx.Client, where: str, headers: dict[str, str]) -> Iterator[httpx.Response]:
    """GET ``where`` (streamed), following at most :data:`MAX_REDIRECTS` redirects and only
    within its origin: a redirect elsewhere is refused unrequested (whatever the client's own
    ``follow_redirects``)."""
    url = start = httpx.URL(where)
    for _ in range(MAX_REDIRECTS + 1):
        with client.stream("GET", url, headers=headers, follow_redirects=False) as reply:
            if not reply.is_redirect:
                yield reply
                return
            try:
                target = url.join(reply.headers["location"])
            except httpx.InvalidURL as exc:
                raise PullError(f"GET {where}: the mirror redirects to a bad URL ({exc}); refused") from exc
        if (target.scheme, target.host, target.port) != (start.scheme, start.host, start.port):
            raise PullError(
                f"GET {where}: the mirror redirects to {target}, another origin than "
                f"{start.scheme}://{start.netloc.decode()}; a pull follows redirects only within the "
                "source's origin, so nothing was requested there: pull from the final URL if you trust it"
            )
        url = target
    raise PullError(f"GET {where}: more than {MAX_REDIRECTS} redirects; refused")


def _plain(reply: httpx.Response, where: str) -> None:
    """Refuse a content-encoded reply: the signed sizes are of the bytes as stored."""
    encoding = reply.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise IntegrityError(
            f"GET {where}: the reply is Content-Encoding {encoding!r} although identity was asked; "
            "a mirror must send the files as they are; refused"
        )


def _open_staged(target: Path, append: bool) -> Any:
    """A staged file opened for writing, never through a symlink (O_NOFOLLOW)."""
    flags = os.O_WRONLY | os.O_CREAT | NOFOLLOW | (os.O_APPEND if append else os.O_TRUNC)
    try:
        fd = os.open(target, flags, 0o644)
    except OSError as exc:
        raise IntegrityError(
            f"{target} cannot be written as a plain file ({exc}); a symlink in the staging folder "
            f"is refused: remove {target.parent} and pull again"
        ) from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise IntegrityError(f"{target} is not a regular file; remove {target.parent} and pull again")
    return os.fdopen(fd, "ab" if append else "wb")


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


def _registered(releases: Path, manifest: dict[str, Any], label: str, number: int) -> str | None:
    """The manifest sha256 recorded for this very version when it is registered here, else None;
    NimmerError if another version holds its number."""
    if not (releases / REGISTRY_FILE).exists():
        return None
    registry = Registry.open(releases)
    try:
        row = registry.db.execute(
            "SELECT version_id, manifest_sha256 FROM base_model_versions WHERE version_number = ?",
            (number,),
        ).fetchone()
    finally:
        registry.close()
    if row is None:
        return None
    if row[0] != manifest["version_id"]:
        raise NimmerError(
            f"{releases / REGISTRY_FILE} already holds {label} with version id {row[0]}, the pulled "
            f"one is {manifest['version_id']}: they are different versions (another publisher?); "
            "pull into another releases folder"
        )
    return str(row[1])


def _refuse_downgrade(registry: Registry, alias: str, label: str, number: int) -> None:
    """PullError when ``alias`` names a newer version than ``label`` (a mirror serving an old,
    validly signed version must not roll a device back)."""
    row = registry.db.execute(
        "SELECT v.version_number, v.version_label FROM aliases a JOIN base_model_versions v "
        "USING (version_id) WHERE a.alias = ?",
        (alias,),
    ).fetchone()
    if row is not None and row[0] > number:
        raise PullError(
            f"{alias} is {row[1]} here and {label} is older: a pull does not move an alias backwards; "
            "pass --allow-downgrade to roll back on purpose, or --no-alias to only register it"
        )


def _damage(releases: Path, label: str, keyring: Keyring) -> str | None:
    """Why the registered ``label`` fails verification here (folder, signature, files, LoRAs),
    or None when it verifies."""
    registry = Registry.open(releases)
    try:
        verify_version(registry, registry.find(label), keyring)
    except NimmerError as exc:
        return str(exc)
    finally:
        registry.close()
    return None


def pull_version(
    releases: Path,
    location: str,
    keyring: Keyring,
    alias: str | None = "production",
    client: httpx.Client | None = None,
    allow_downgrade: bool = False,
    manifest_sha256: str | None = None,
) -> PullResult:
    """Pull the version at ``location`` into ``releases`` (see the module docstring) and point
    ``alias`` at it (never to an older version unless ``allow_downgrade``); the same version
    pulled again is verified and only moves the alias, or is repaired when it fails.
    ``manifest_sha256`` (from a mirror's signed index): the only manifest accepted."""
    started = time.perf_counter()
    source = Source(location, client)
    try:
        return _pull(releases, source, keyring, alias, allow_downgrade, started, manifest_sha256)
    finally:
        if client is None and source.http:
            source.client.close()


def _pull(
    releases: Path,
    source: Source,
    keyring: Keyring,
    alias: str | None,
    downgrade: bool,
    started: float,
    expect: str | None = None,
) -> PullResult:
    raw, sig_raw, key_id, manifest = _signed_manifest(source, keyring)
    label, number = _label(manifest)
    if source.name != label:
        raise PullError(
            f"{source.location} names {source.name}, but its signed manifest is {label}: the source "
            "serves another version than the one asked for; refused, nothing was fetched"
        )
    digest = hashlib.sha256(raw).hexdigest()
    if expect is not None and digest != expect:
        raise IntegrityError(
            f"{source.where(MANIFEST)} (sha256 {digest[:12]}) is not the manifest the mirror's signed "
            f"index names for {label} ({expect[:12]}); refused, nothing else was fetched"
        )
    files = manifest["blob_distribution"]["files"]
    loras = [c for c in manifest.get("compatible_loras", []) if isinstance(c, dict)]
    _drop_finished(releases)
    recorded = _registered(releases, manifest, label, number)
    if alias and not downgrade and (releases / REGISTRY_FILE).exists():
        registry = Registry.open(releases)
        try:
            _refuse_downgrade(registry, alias, label, number)
        finally:
            registry.close()
    repair = False
    if recorded is not None:
        repair = _needs_repair(releases, label, keyring, recorded, digest)
        if not repair:
            _set_alias(releases, label, number, alias, downgrade)
            return PullResult(label, key_id, 0, 0, 0, True, alias, time.perf_counter() - started)

    work = releases / PULLS / f"{label}-{digest[:16]}"
    staged = work / "version"
    discarded = _prepare(releases / PULLS, work, _listed(label, files, loras))
    staged.mkdir(parents=True, exist_ok=True)
    for name, data in ((MANIFEST, raw), (SIGNATURE, sig_raw)):
        with _open_staged(staged / name, append=False) as out:
            out.write(data)
    tally = _Tally()
    for row in files:
        tally.add(*_fetch_checked(source, source.where(row["path"]), staged / row["path"], row, label))
    new_loras = _fetch_loras(releases, source, work, loras, label, tally)

    staging = Staging(work, _snapshot(work), repair, alias, downgrade)  # before the checks: a change
    try:  # during or after them shows under the lock
        _verify_staged(staged, raw, manifest, keyring, loras, new_loras, label)
        _commit(releases, staged, manifest, digest, key_id, loras, new_loras, staging)
    except (IntegrityError, SignatureError) as exc:
        shutil.rmtree(work, ignore_errors=True)
        raise IntegrityError(
            f"{exc}; the staging folder {work} was discarded and nothing was registered: run the "
            "same pull again"
        ) from exc
    for stale in (releases / PULLS).glob(f"{label}-*"):  # this pull's, and older attempts' at it
        shutil.rmtree(stale, ignore_errors=True)
    return PullResult(
        label,
        key_id,
        tally.count,
        tally.fetched,
        tally.resumed,
        False,
        alias,
        time.perf_counter() - started,
        repair,
        tuple(discarded),
    )


def is_version_location(location: str) -> bool:
    """Whether ``location`` names a version folder (``.../nimmerworld-base-vN``), not a mirror."""
    location = location.rstrip("/")
    if location.endswith(f"/{MANIFEST}"):
        location = location[: -len(MANIFEST) - 1]
    return re.fullmatch(rf"{PREFIX}\d+", re.split(r"[/\\]", location)[-1]) is not None


def pull_from_mirror(
    releases: Path,
    mirror: str,
    selector: str,
    keyring: Keyring,
    alias: str | None = "production",
    client: httpx.Client | None = None,
    allow_downgrade: bool = False,
    allow_expired: bool = False,
    accept_index_id: str | None = None,
) -> tuple[dict[str, Any], PullResult]:
    """Pull the version that ``selector`` (``newest``, an alias, ``vN``) names in the signed index
    of the mirror at ``mirror`` (its releases folder: URL or path); returns the index and the
    pull. The index is verified; refused when expired (unless ``allow_expired``), under another
    index_id than the pinned one (unless it is ``accept_index_id``) or older than one this
    device read; the version's manifest must be the one the index names."""
    source = Source(mirror, client)
    try:
        where = source.where(INDEX)
        hint = f"a mirror's releases folder (publish writes {INDEX} there), or give a version URL"
        index, _ = read_index(source.read(INDEX, hint), keyring, where)
        entry = resolve(index, selector, where)
        _refuse_rollback(releases, index, where, accept_index_id)  # named first: the graver
        _refuse_expired(index, where, allow_expired)
        result = pull_version(
            releases,
            source.where(entry["label"]),
            keyring,
            alias,
            client=source.client if source.http else None,
            allow_downgrade=allow_downgrade,
            manifest_sha256=entry["manifest_sha256"],
        )
    finally:
        if client is None and source.http:
            source.client.close()
    _record_seen(releases, index)
    return index, result


def _refuse_expired(index: dict[str, Any], where: str, allow: bool) -> None:
    """PullError for an expired index (:func:`index.expired`) unless ``allow``: a mirror that
    froze keeps serving a validly signed index while the publisher moves on."""
    why = expired(index)
    if why is not None and not allow:
        raise PullError(
            f"the mirror's index {where} (sequence {index['sequence']}) is not current: {why}; the "
            "mirror may be frozen, serving an old index: pull from another mirror or ask the publisher "
            "to re-sign it (nimmer versions sign-index); --allow-expired-index uses it anyway (an "
            "offline copy); nothing was fetched"
        )


def _pinned(registry: Registry) -> set[str]:
    """The index ids this device follows: the one it pinned, or (a device that pulled before
    pins) every id it recorded a sequence for; empty before its first mirror pull."""
    pinned = registry.setting(PIN_SETTING)
    if pinned is not None:
        return {pinned}
    rows = registry.db.execute("SELECT key FROM settings WHERE key LIKE ?", (SEEN_SETTING + "%",))
    return {str(r[0])[len(SEEN_SETTING) :] for r in rows}


def _refuse_rollback(releases: Path, index: dict[str, Any], where: str, accept_id: str | None) -> None:
    """PullError when the index is under another index_id than the one this device pinned (an
    older releases folder of the same key re-served would roll ``newest`` back, and its sequence
    is not comparable) unless ``accept_id`` names it; or when this device already read a later
    index of that id (a stale or rolled-back mirror)."""
    if accept_id is not None and accept_id != index["index_id"]:  # even at a first pull: never another
        raise PullError(
            f"the mirror's index {where} is index_id {index['index_id']}, not {accept_id} that "
            "--accept-index-id names; refused, nothing was fetched"
        )
    if not (releases / REGISTRY_FILE).exists():
        return
    registry = Registry.open(releases)
    try:
        pinned = _pinned(registry)
        seen = registry.setting(SEEN_SETTING + index["index_id"])
        latest = registry.setting(ISSUED_SETTING)
    finally:
        registry.close()
    if pinned and index["index_id"] not in pinned and accept_id == index["index_id"] and latest:
        _refuse_earlier_folder(index, where, latest)  # named on purpose, yet an earlier folder
    if pinned and index["index_id"] not in pinned and accept_id != index["index_id"]:
        raise PullError(
            f"the mirror's index {where} is index_id {index['index_id']} (sequence {index['sequence']}, "
            f"issued {index.get('issued_at')}), but this device follows {', '.join(sorted(pinned))}, "
            "pinned at its first pull from a mirror: another releases folder, or an old one re-served "
            "to roll newest back; refused, nothing was fetched. If the publisher really moved to a new "
            f"releases folder, pass --accept-index-id {index['index_id']}"
        )
    if seen is not None and int(seen) > index["sequence"]:
        raise PullError(
            f"the mirror's index {where} is sequence {index['sequence']} (issued "
            f"{index.get('issued_at')}), older than sequence {seen} this device already read from that "
            "publisher: a stale or rolled-back mirror; refused, nothing was fetched"
        )


def _refuse_earlier_folder(index: dict[str, Any], where: str, latest: str) -> None:
    """PullError when an index under a new id was issued before the latest index this device
    read: an earlier releases folder (its id is the one the pin refusal tells the operator to
    name), re-served to roll ``newest`` back; a folder the publisher moved to is signed anew."""
    if datetime.fromisoformat(index["issued_at"]) < datetime.fromisoformat(latest):
        raise PullError(
            f"the mirror's index {where} (index_id {index['index_id']}, issued {index['issued_at']}) "
            f"was issued before the latest index this device read ({latest}): an earlier releases "
            "folder, not one the publisher moved to; refused even when --accept-index-id names it, "
            "nothing was fetched. If it really is current, ask the publisher to sign its index anew "
            "(nimmer versions sign-index)"
        )


def _record_seen(releases: Path, index: dict[str, Any]) -> None:
    """Pin the index's id (the first, or one accepted on purpose), remember the highest
    sequence read under it and the latest issued_at read (``_refuse_rollback``)."""
    registry = Registry.open(releases, create=True)
    try:
        with registry.writing():
            registry.set_setting(PIN_SETTING, index["index_id"])
            latest = registry.setting(ISSUED_SETTING)
            # never later than now: an index dated ahead (a publisher's clock) would block every move
            issued = min(datetime.fromisoformat(index["issued_at"]), datetime.now(UTC).replace(microsecond=0))
            if latest is None or datetime.fromisoformat(latest) < issued:
                registry.set_setting(ISSUED_SETTING, issued.isoformat())
            key = SEEN_SETTING + index["index_id"]
            seen = registry.setting(key)
            if seen is None or int(seen) < index["sequence"]:
                registry.set_setting(key, str(index["sequence"]))
    finally:
        registry.close()


def _signed_manifest(source: Source, keyring: Keyring) -> tuple[bytes, bytes, str, dict[str, Any]]:
    """The source's manifest and signature bytes, the signing key id and the manifest, its
    signature checked before any other byte is fetched."""
    raw = source.read(MANIFEST)
    sig_raw = source.read(SIGNATURE)
    signature = _json(sig_raw, source.where(SIGNATURE))
    key_id = keyring.verify(raw, signature, source.where(MANIFEST))  # before any other byte
    return raw, sig_raw, key_id, _json(raw, source.where(MANIFEST))


def _json(data: bytes, where: str) -> Any:
    """``data`` parsed, or :class:`IntegrityError` naming ``where`` (not JSON, not UTF-8, or
    nested deeper than the parser's recursion limit)."""
    try:
        return json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"{where} is not readable JSON ({exc}); refused before any other fetch") from exc
    except RecursionError as exc:
        raise IntegrityError(
            f"{where} is nested deeper than a JSON parser goes; a signature or manifest is a flat "
            "object: refused before any other fetch"
        ) from exc


def _needs_repair(releases: Path, label: str, keyring: Keyring, recorded: str, digest: str) -> bool:
    """Whether the registered ``label`` must be fetched again (it fails verification here); only
    the manifest it was registered with (sha256 ``recorded``) may repair it."""
    problem = _damage(releases, label, keyring)
    if problem is None:
        return False
    if recorded != digest:
        raise IntegrityError(
            f"{label} is registered here but fails verification ({problem}); the pulled manifest "
            f"(sha256 {digest[:12]}) is not the one registered ({recorded[:12]}), so it cannot "
            "repair it: pull it from the mirror it first came from"
        )
    return True


def _listed(label: str, files: list[dict[str, Any]], loras: list[dict[str, Any]]) -> set[str]:
    """Every path the staging folder may hold: the version's files and the LoRAs' (each checked
    to stay inside its folder)."""
    listed = {f"version/{name}" for name in (MANIFEST, SIGNATURE)}
    for row in files:
        rel = safe_relative(row["path"], label)
        if rel in (MANIFEST, SIGNATURE):
            raise IntegrityError(f"{label}: the manifest lists {rel} as a blob; refused")
        listed.add(f"version/{rel}")
    for entry in loras:
        rel = _lora_folder(entry, label)
        what = f"LoRA {entry['lora_id']}"
        listed |= {f"{rel}/{safe_relative(r['path'], what)}" for r in entry["files"]}
    return listed


@dataclass
class _Tally:
    """Files checked and bytes transferred (fetched) or continued (resumed) by one pull."""

    fetched: int = 0
    resumed: int = 0
    count: int = 0

    def add(self, fetched: int, resumed: int) -> None:
        self.fetched += fetched
        self.resumed += resumed
        self.count += 1


def _fetch_loras(
    releases: Path, source: Source, work: Path, loras: list[dict[str, Any]], label: str, tally: _Tally
) -> dict[str, Path]:
    """Fetch into ``work`` each LoRA not already here intact; {lora_id: its staged folder}."""
    new_loras: dict[str, Path] = {}
    for entry in loras:
        rel = _lora_folder(entry, label)
        if (releases / rel).is_dir() and _lora_registered(releases, entry["lora_id"]):
            try:
                check_files(releases / rel, entry["files"], f"LoRA {entry['lora_id']} (already here)")
                continue
            except IntegrityError:
                pass  # damaged here: fetched again below and put back in place under the lock
        folder = work / rel
        for row in entry["files"]:
            where = source.where(f"{rel}/{row['path']}", lora=True)
            tally.add(*_fetch_checked(source, where, folder / row["path"], row, f"LoRA {entry['lora_id']}"))
        new_loras[entry["lora_id"]] = folder
    return new_loras


def _verify_staged(
    staged: Path,
    raw: bytes,
    manifest: dict[str, Any],
    keyring: Keyring,
    loras: list[dict[str, Any]],
    new_loras: dict[str, Path],
    label: str,
) -> None:
    """The same check every reader runs, on the staged folder, before it can be seen; and the
    fetched LoRAs' files."""
    verified = verify_folder(staged, keyring)
    if (staged / MANIFEST).read_bytes() != raw or verified.get("version_id") != manifest["version_id"]:
        raise IntegrityError(f"{label}: the staged manifest changed while pulling")
    for entry in loras:
        if entry["lora_id"] in new_loras:
            check_files(new_loras[entry["lora_id"]], entry["files"], f"LoRA {entry['lora_id']}")


@dataclass(frozen=True)
class Staging:
    """What ``_commit`` needs beyond the manifest: the staging folder and its verified state."""

    work: Path
    snapshot: dict[str, tuple[int, ...]]
    repair: bool  # the version is registered: replace its folder, insert no rows
    alias: str | None
    downgrade: bool


def _prepare(pulls: Path, work: Path, listed: set[str]) -> list[str]:
    """Make the staging folder the pull's own before fetching into it: refuse ``.pulls``, the
    folder or anything in it being a symlink; delete files the manifest does not list (and a
    folder where a listed file belongs). Returns what was deleted."""
    for path in (pulls, work):
        if path.is_symlink():
            raise IntegrityError(
                f"{path} is a symlink; a pull stages only inside releases/: remove it and pull again"
            )
    discarded: list[str] = []
    if not work.is_dir():
        return discarded
    for root, dirs, names in os.walk(work):
        for name in sorted(names + dirs):
            path = Path(root) / name
            rel = path.relative_to(work).as_posix()
            if path.is_symlink():
                raise IntegrityError(
                    f"{rel} in the staging folder {work} is a symlink; a pull writes only its own plain "
                    f"files: remove {work} and pull again"
                )
            if name in dirs and rel in listed:
                shutil.rmtree(path)
                dirs.remove(name)
                discarded.append(f"{rel}/")
            elif name in names and rel not in listed:
                path.unlink()
                discarded.append(rel)
    return discarded


def _snapshot(work: Path) -> dict[str, tuple[int, ...]]:
    """Every path under ``work`` with its inode, size, mtime and ctime (ctime cannot be set back)."""
    seen: dict[str, tuple[int, ...]] = {}
    for root, dirs, names in os.walk(work):
        for name in dirs + names:
            st = os.lstat(Path(root) / name)
            rel = (Path(root) / name).relative_to(work).as_posix()
            seen[rel] = (st.st_mode, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
    return seen


def _drop_finished(releases: Path) -> None:
    """Delete staging folders of pulls that committed but were killed before cleaning up: the
    version is registered with that manifest and its folder was renamed out of the staging."""
    pulls = releases / PULLS
    if pulls.is_symlink() or not pulls.is_dir() or not (releases / REGISTRY_FILE).exists():
        return
    registry = Registry.open(releases)
    try:
        done = {
            f"{r[0]}-{r[1][:16]}"
            for r in registry.db.execute("SELECT version_label, manifest_sha256 FROM base_model_versions")
        }
    finally:
        registry.close()
    for folder in pulls.iterdir():
        if folder.name in done and not folder.is_symlink() and not (folder / "version").exists():
            shutil.rmtree(folder, ignore_errors=True)


def _lora_registered(releases: Path, lora_id: str) -> bool:
    if not (releases / REGISTRY_FILE).exists():
        return False
    registry = Registry.open(releases)
    try:
        return registry.lora(lora_id) is not None
    finally:
        registry.close()


def _commit(
    releases: Path,
    staged: Path,
    manifest: dict[str, Any],
    digest: str,
    key_id: str,
    loras: list[dict[str, Any]],
    new_loras: dict[str, Path],
    staging: Staging,
) -> None:
    """Under the registry's write lock: check the staging folder is as verified, rename the
    verified folders into place, insert the rows (publish's own row format; ``candidate`` is left
    where it was), move the alias; a kill before the commit leaves folders without rows, which
    the next publish or pull removes."""
    label, number = manifest["version_label"], int(manifest["version_label"].rsplit("v", 1)[1])
    for folder in [staged, *new_loras.values()]:
        fsync_tree(folder)
    registry = Registry.open(releases, create=True)
    try:
        with registry.writing():
            registry.remove_leftovers()
            known = {v.label: v.id for v in registry.versions()}
            if not staging.repair and manifest["version_id"] in known.values():  # another pull won
                return
            if staging.alias and not staging.downgrade:
                _refuse_downgrade(registry, staging.alias, label, number)
            if _snapshot(staging.work) != staging.snapshot:
                raise IntegrityError(
                    f"{label}: a file in the staging folder {staging.work} changed after it was "
                    "verified (another process writes there?)"
                )
            registered = {k for k in new_loras if registry.lora(k) is not None}  # damaged, or a race
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
            candidate = registry.db.execute(
                "SELECT version_id, set_at FROM aliases WHERE alias = 'candidate'"
            ).fetchone()
            if not staging.repair:
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
                            "carry": [],  # the decisions stay in the signed manifest (lora_carry)
                        },
                    )
                except sqlite3.IntegrityError as exc:
                    raise NimmerError(
                        f"{label} cannot be registered in {releases / REGISTRY_FILE} ({exc}): it clashes "
                        "with a version already there; pull into another releases folder"
                    ) from exc
                _keep_candidate(registry, candidate)
            _put(releases / label, staged, staging.work)
            for lora_id, folder in new_loras.items():
                (releases / "loras").mkdir(exist_ok=True)
                target = releases / "loras" / lora_id
                if not target.exists() or lora_id in registered:  # missing, or damaged: put it back
                    _put(target, folder, staging.work)
            fsync_dir(releases)
            if staging.alias:
                registry.set_alias(staging.alias, registry.find(label), _now())
    finally:
        registry.close()


def _put(target: Path, folder: Path, work: Path) -> None:
    """Rename the verified ``folder`` to ``target``, moving a folder already there (a damaged
    copy being repaired) into the staging folder, which is deleted after the commit."""
    if target.exists() or target.is_symlink():
        os.replace(target, work / f"replaced-{target.name}")
    os.replace(folder, target)


def _keep_candidate(registry: Registry, candidate: sqlite3.Row | None) -> None:
    """Undo ``_insert``'s move of ``candidate`` (publish's habit): a pull never moves it."""
    if candidate is None:
        registry.db.execute("DELETE FROM aliases WHERE alias = 'candidate'")
    else:
        registry.db.execute(
            "UPDATE aliases SET version_id = ?, set_at = ? WHERE alias = 'candidate'", tuple(candidate)
        )


def _set_alias(releases: Path, label: str, number: int, alias: str | None, downgrade: bool) -> None:
    if not alias:
        return
    registry = Registry.open(releases)
    try:
        with registry.writing():
            if not downgrade:
                _refuse_downgrade(registry, alias, label, number)
            registry.set_alias(alias, registry.find(label), _now())
    finally:
        registry.close()


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
