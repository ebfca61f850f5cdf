"""The player's own LoRAs on the device and their backups on the backup host: what ``nimmer
backup create|list|restore`` runs.

A player's LoRA is a PEFT adapter folder in ``PLAYER_DIR/loras/<name>/`` (the design's
gameplay-accrued LoRAs, ``player_lora_backups``). ``create`` packs the folder into one bundle
(:func:`pack`: a JSON header naming each file with its size and sha256, then the files' bytes),
seals it on the device (``sealing.seal``: the passphrase and recovery codes unlock it, the host
never can) and uploads it as the next version of that name to this device's account
(``service.BackupClient``, every request signed with the device key ``PLAYER_DIR/backup_key.pem``).
``restore`` downloads a version, checks that the authenticated metadata is exactly the backup
asked for (account, backup id, name, version: another account's blob or an older one is
refused), unseals it, checks every file of the bundle and puts the folder in place atomically.

The device keeps a receipt, ``PLAYER_DIR/lora_backups.json``: per name, the last version backed
up or restored and its files' sha256, so ``list`` can say whether the local copy is the backup,
changed since, or missing, and ``restore`` with no name restores every LoRA whose local copy is
missing or no longer matches its backup (a lost or damaged folder).

The backup account belongs to the device key: restoring on another machine needs this player
folder's ``backup_key.pem`` (keep a copy with the recovery codes).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from nimmer_train.artifacts import (
    MANIFEST,
    file_table,
    fsync_dir,
    fsync_tree,
    write_json_atomic,
    write_secret,
)
from nimmer_train.backup.device import DeviceKey
from nimmer_train.backup.sealing import BackupError, seal
from nimmer_train.backup.service import MAX_BODY_BYTES, BackupClient

LORAS = "loras"  # PLAYER_DIR/loras/<name>/: the player's own LoRA folders
KEY_FILE = "backup_key.pem"  # the device's backup key (0600); not the A.2 intake key
RECEIPT = "lora_backups.json"
BUNDLE_FORMAT = "nimmer-lora-folder/1"
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MAX_FILES = 64


@dataclass(frozen=True)
class Created:
    name: str
    version: int
    backup_id: str
    size_bytes: int  # the folder's bundle, before sealing
    sealed_bytes: int  # what was uploaded
    account: str
    recovery_codes: list[str]


def lora_folder(player_dir: Path, name: str) -> Path:
    if not NAME_RE.fullmatch(name):
        raise BackupError(
            f"LoRA name {name!r}: use 1-128 letters, digits, '.', '_' or '-', starting with a letter or digit"
        )
    return player_dir / LORAS / name


def device_client(player_dir: Path, host: str) -> BackupClient:
    """The backup host's client for this player folder's device key (made, 0600, on first use)
    and registered with the host (again is harmless)."""
    if not player_dir.is_dir():
        raise BackupError(f"no player folder at {player_dir}")
    path = player_dir / KEY_FILE
    if not path.exists():
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs stands
            DeviceKey.generate().save(path)
    client = BackupClient(host.rstrip("/"), DeviceKey.load(path))
    try:
        client.register()
    except httpx.HTTPError as exc:  # the host is not there, or not a backup host
        raise BackupError(f"the backup host {host} cannot be reached ({type(exc).__name__}: {exc})") from exc
    return client


def pack(folder: Path) -> bytes:
    """The adapter folder as one bundle: a JSON header line, then every file's bytes in order."""
    if folder.is_symlink() or not folder.is_dir():
        raise BackupError(f"no LoRA folder at {folder} (a PEFT adapter folder: adapter_config.json, weights)")
    links = [p for p in folder.rglob("*") if p.is_symlink()]
    if links:
        raise BackupError(f"{links[0]} is a symlink; a LoRA backup holds the folder's own files only")
    files = [{k: row[k] for k in ("path", "size", "sha256")} for row in _files(folder)]
    if not files or len(files) > MAX_FILES:
        raise BackupError(f"{folder} holds {len(files)} files; a LoRA folder holds 1-{MAX_FILES}")
    header = json.dumps({"format": BUNDLE_FORMAT, "files": files}, sort_keys=True).encode()
    return header + b"\n" + b"".join((folder / f["path"]).read_bytes() for f in files)


def _files(folder: Path) -> list[dict[str, Any]]:
    rows = file_table(folder)
    if (folder / MANIFEST).is_file():  # file_table leaves the manifest out; a backup keeps it
        data = (folder / MANIFEST).read_bytes()
        rows.append({"path": MANIFEST, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return sorted(rows, key=lambda r: r["path"])


def unpack(bundle: bytes, target: Path, what: str) -> list[dict[str, Any]]:
    """Check the bundle (its header, every file's size and sha256) and put its folder at
    ``target`` in one rename; returns its file rows. Nothing is written when a check fails."""
    head, sep, body = bundle.partition(b"\n")
    try:
        header = json.loads(head) if sep else None
    except (ValueError, UnicodeDecodeError, RecursionError):
        header = None
    files = header.get("files") if isinstance(header, dict) else None
    if not isinstance(header, dict) or header.get("format") != BUNDLE_FORMAT or not isinstance(files, list):
        raise BackupError(f"{what} does not hold a LoRA folder ({BUNDLE_FORMAT}); nothing was restored")
    offset, parts, dirs = 0, [], set()
    for row in files:
        path = row.get("path") if isinstance(row, dict) else None
        if not isinstance(path, str) or any(p in ("", ".", "..") for p in path.split("/")) or "\\" in path:
            raise BackupError(f"{what}: file path {path!r} is not inside its folder; nothing was restored")
        above = {path.rsplit("/", n)[0] for n in range(1, path.count("/") + 1)}
        if path in dirs or any(p == path or p in above for p, _ in parts):
            raise BackupError(
                f"{what}: its header names {path!r} twice, or a file inside a file; nothing was restored"
            )
        dirs |= above
        size = row.get("size")
        data = body[offset : offset + size] if isinstance(size, int) and size >= 0 else b""
        if len(data) != size or hashlib.sha256(data).hexdigest() != row.get("sha256"):
            raise BackupError(f"{what}: file {path} does not match its size and sha256; nothing was restored")
        parts.append((path, data))
        offset += size
    if offset != len(body):
        raise BackupError(f"{what}: {len(body) - offset} bytes beyond its files; nothing was restored")
    _put_folder(target, parts, what)
    return files


def _put_folder(target: Path, parts: list[tuple[str, bytes]], what: str) -> None:
    """Write ``parts`` into a fresh staging folder beside ``target``, then swap it in: the old
    folder is renamed aside (never emptied in place) and put back if the rename in fails, so a
    reader sees the old folder or the new one whole, never a half one. A kill between the two
    renames leaves no folder (``restore`` with no name then restores it again) and a hidden
    ``.NAME.*`` leftover, never a mix; the next restore of that name deletes it. A ``target``
    that is a symlink is refused, not followed."""
    if target.is_symlink() or (target.exists() and not target.is_dir()):
        raise BackupError(
            f"{what}: {target} is a symlink or not a folder; a restore replaces only the player's own "
            "LoRA folder: move it aside and restore again"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    _drop_leftovers(target)
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging, old = (target.parent / f".{target.name}.{kind}-{tag}" for kind in ("restore", "old"))
    staging.mkdir(mode=0o700)
    try:
        for path, data in parts:
            (staging / path).parent.mkdir(parents=True, exist_ok=True)
            write_secret(staging / path, data)  # 0600: the player's own patterns
        fsync_tree(staging)
        if target.exists():
            os.replace(target, old)
        try:
            os.replace(staging, target)
        except OSError:
            if old.exists():
                os.replace(old, target)
            raise
        fsync_dir(target.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)


def _drop_leftovers(target: Path) -> None:
    """Delete the hidden staging and old folders of restores of ``target`` killed before they
    cleaned up (their process is gone); a live restore's are left to it."""
    for path in target.parent.glob(f".{target.name}.*-*-*"):
        kind, _, rest = path.name[len(target.name) + 2 :].partition("-")
        pid = rest.split("-", 1)[0]
        if kind not in ("restore", "old") or not pid.isdigit() or path.is_symlink():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:  # alive, another user's
            continue


def _receipt(player_dir: Path) -> dict[str, Any]:
    path = player_dir / RECEIPT
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise BackupError(f"{path} is not readable JSON ({exc}); move it aside (it is rebuilt)") from exc
    return data if isinstance(data, dict) else {}


def _remember(player_dir: Path, name: str, row: dict[str, Any], files: list[dict[str, Any]]) -> None:
    receipt = _receipt(player_dir)
    receipt[name] = {
        "version": row["lora_version"],
        "backup_id": row["backup_id"],
        "files": {f["path"]: f["sha256"] for f in files},
        "at": time.time(),
    }
    write_json_atomic(player_dir / RECEIPT, receipt)


def damage(folder: Path) -> str | None:
    """Why the LoRA folder cannot be loaded (its adapter_config.json or a safetensors file is
    missing, unreadable or truncated), or None. A folder that loads but differs from its backup
    is the LoRA having moved on through play, not damage."""
    from safetensors import safe_open

    config = folder / "adapter_config.json"
    try:
        if not isinstance(json.loads(config.read_text()), dict):
            return f"{config.name} is not a JSON object"
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        return f"{config.name} cannot be read ({type(exc).__name__})"
    weights = sorted(folder.glob("*.safetensors"))
    if not weights:
        return "no .safetensors weights"
    for path in weights:
        try:
            with safe_open(str(path), "np") as tensors:
                for key in tensors.keys():  # noqa: SIM118 - safe_open has no __iter__
                    tensors.get_slice(key).get_shape()
        except Exception as exc:  # safetensors raises its own error types for a bad header
            return f"{path.name} cannot be opened ({type(exc).__name__})"
    return None


def local_state(player_dir: Path, name: str) -> str:
    """``missing``, ``damaged: why``, ``backed up as vN``, ``changed since vN`` or ``never backed up``."""
    folder = lora_folder(player_dir, name)
    if not folder.is_dir():
        return "missing"
    problem = damage(folder)
    if problem is not None:
        return f"damaged: {problem}"
    seen = _receipt(player_dir).get(name)
    if not isinstance(seen, dict):
        return "never backed up"
    here = {f["path"]: f["sha256"] for f in _files(folder)}
    return f"{'backed up as' if here == seen.get('files') else 'changed since'} v{seen.get('version')}"


def create(
    player_dir: Path, name: str, client: BackupClient, passphrase: str, recovery_codes: int = 8
) -> Created:
    """Seal ``PLAYER_DIR/loras/<name>`` and upload it as the next version of ``name``."""
    bundle = pack(lora_folder(player_dir, name))
    version = 1 + max((r["lora_version"] for r in client.list() if r["lora_name"] == name), default=0)
    sealed, codes = seal(
        bundle, passphrase, {"lora_name": name, "lora_version": version}, client.account, recovery_codes
    )
    blob = sealed.to_bytes()
    if len(blob) > MAX_BODY_BYTES:
        raise BackupError(
            f"{name}: the sealed backup is {len(blob)} bytes, over the backup host's limit of "
            f"{MAX_BODY_BYTES} (a player LoRA is a few MB at most: check the folder holds only the adapter)"
        )
    backup_id = client.upload(sealed)
    files = json.loads(bundle.partition(b"\n")[0])["files"]
    _remember(player_dir, name, {"lora_version": version, "backup_id": backup_id}, files)
    return Created(name, version, backup_id, len(bundle), len(blob), client.account, codes)


def rows(client: BackupClient) -> list[dict[str, Any]]:
    """What the host holds for this device's account, by name and version."""
    return sorted(client.list(), key=lambda r: (r["lora_name"], r["lora_version"]))


def to_restore(player_dir: Path, client: BackupClient, name: str | None) -> list[dict[str, Any]]:
    """The host's newest row of ``name``, or, with no name, of every name whose local folder is
    missing or damaged (one that loads but changed since its backup is kept: it moved on)."""
    newest: dict[str, dict[str, Any]] = {}
    for row in rows(client):
        newest[row["lora_name"]] = row
    if name is not None:
        lora_folder(player_dir, name)
        if name not in newest:
            held = ", ".join(sorted(newest)) or "none"
            raise BackupError(
                f"the backup host holds no backup of {name!r} for this device (it holds: {held})"
            )
        return [newest[name]]
    return [
        r for n, r in sorted(newest.items()) if local_state(player_dir, n).startswith(("missing", "damaged"))
    ]


def restore(
    player_dir: Path,
    client: BackupClient,
    row: dict[str, Any],
    passphrase: str | None = None,
    recovery_code: str | None = None,
) -> Path:
    """Download, verify and unseal the backup ``row`` and put its folder in place."""
    name, version = row["lora_name"], row["lora_version"]
    what = f"backup {name} v{version} ({row['backup_id']})"
    _receipt(player_dir)  # unreadable: refused before the folder is replaced, not after
    try:
        bundle = client.restore(name, version, passphrase, recovery_code)
        target = lora_folder(player_dir, name)
        files = unpack(bundle, target, what)
    except BackupError as exc:
        if str(exc).startswith(what):
            raise
        raise BackupError(f"{what}: {exc}") from exc
    _remember(player_dir, name, row, files)
    return target
