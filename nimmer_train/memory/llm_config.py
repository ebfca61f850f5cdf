"""The player's LLM configuration on the device: the design's ``player_llm_config`` row ("Schema
sketch (player LLM configuration + cloud LoRA backup)") and the player's own provider keys (BYOK).

It lives in its own store, ``llm_config.sqlite`` beside the player's memory stores and off the
sync graph (nothing in sync.py reads it), schema-versioned like the others (PRAGMA user_version).
A BYOK key is sealed with the backup sealing code (AES-256-GCM under a scrypt-derived key) and
only its ``*_credentials_ref`` (a uuid) sits in the row. The sealing secret is the device's
runtime key, :data:`KEY_FILE` (mode 0600, made on first use): the runtime reads keys with
:func:`read_key`; no other command prints them. The design's rules are checked when the row is set:
the Tier x Ring matrix (Theia never on Ring A), a known provider profile, and the hivemind fixed to
Anthropic through us. The row's ``feature_compat_warnings`` are computed then, as the design says.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import time
import uuid
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import write_secret
from nimmer_train.backup.sealing import Sealed, seal, unseal
from nimmer_train.errors import ConfigError, NimmerError
from nimmer_train.memory.db import connect, migrate

CONFIG_FILE = "llm_config.sqlite"
KEY_FILE = "runtime.key"
# the key is made as secrets.token_urlsafe(32): 43 characters; anything under 32 (an empty file
# left by a write cut short, a hand-edited stub) would seal the clasp and BYOK keys under a guess
MIN_SECRET_CHARS = 32
RING_CODES = ("A_local", "B_our_farm", "C_external")
TIERS = ("casual", "deep")

LLM_CONFIG_SCHEMA_V1 = """
CREATE TABLE player_llm_config (
    player_id TEXT PRIMARY KEY,
    casual_tier_ring TEXT NOT NULL CHECK (casual_tier_ring IN ('A_local', 'B_our_farm', 'C_external')),
    casual_tier_provider TEXT,
    casual_tier_endpoint TEXT,
    casual_tier_model TEXT,
    casual_tier_credentials_ref TEXT,
    deep_tier_ring TEXT CHECK (deep_tier_ring IS NULL OR deep_tier_ring IN ('B_our_farm', 'C_external')),
    deep_tier_provider TEXT,
    deep_tier_endpoint TEXT,
    deep_tier_model TEXT,
    deep_tier_credentials_ref TEXT,
    hivemind_tier_provider TEXT NOT NULL DEFAULT 'anthropic_via_us',
    lora_backup_enabled INTEGER NOT NULL DEFAULT 0,
    lora_backup_last_sync REAL,
    lora_encryption_key_ref TEXT,
    feature_compat_warnings TEXT NOT NULL DEFAULT '{}',
    configured_at REAL NOT NULL,
    last_modified REAL
);
CREATE TABLE byok_credentials (ref TEXT PRIMARY KEY, sealed BLOB NOT NULL, created_at REAL NOT NULL);
"""
MIGRATIONS = (LLM_CONFIG_SCHEMA_V1,)
FIELDS = (
    *(f"{t}_tier_{k}" for t in TIERS for k in ("ring", "provider", "endpoint", "model")),
    "hivemind_tier_provider",
    "lora_backup_enabled",
)


def _open(folder: Path) -> Any:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / CONFIG_FILE
    db = connect(path)
    migrate(db, MIGRATIONS, path)
    return db


def device_secret(folder: Path) -> str:
    """The runtime's sealing secret for this device (made once, mode 0600)."""
    path = folder / KEY_FILE
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs stands
            write_secret(path, secrets.token_urlsafe(32).encode())
    mode = path.stat().st_mode
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise NimmerError(f"{path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    try:
        secret = path.read_text(encoding="utf-8").strip()
    except UnicodeDecodeError:
        secret = ""
    if len(secret) < MIN_SECRET_CHARS:
        raise NimmerError(
            f"{path} holds {len(secret)} usable characters, not a device key (at least "
            f"{MIN_SECRET_CHARS}: an empty or short file is what a write cut short leaves, and what "
            f"is sealed under it anyone could open). Put back this device's {KEY_FILE} from a backup, "
            f"or move it aside (e.g. to {KEY_FILE}.broken) and a new key is made on the next start; "
            f"what the old key sealed cannot be opened then: move clasp.sealed aside too (the "
            f"in-between memories it holds are lost) and enter your provider keys again"
        )
    return secret


def _check(row: dict[str, Any]) -> dict[str, list[str]]:
    """The design's rules on a row; returns its feature_compat_warnings per tier."""
    from nimmer_train.config.providers import HIVEMIND_PROVIDER, check_tier_ring, config_warnings, profile

    warnings: dict[str, list[str]] = {}
    if row.get("casual_tier_ring") is None:
        raise ConfigError("casual_tier_ring", f"required; one of {', '.join(RING_CODES)}")
    for tier in TIERS:
        code = row.get(f"{tier}_tier_ring")
        if code is None:
            continue
        if code not in RING_CODES:
            raise ConfigError(f"{tier}_tier_ring", f"{code!r}; known: {', '.join(RING_CODES)}")
        check_tier_ring(tier, code[0])
        if code == "C_external":
            provider = row.get(f"{tier}_tier_provider") or "openai_compatible"
            profile(provider)
            if not row.get(f"{tier}_tier_model"):
                raise ConfigError(f"{tier}_tier_model", "C_external needs the provider's model name")
            warnings[f"{tier}_tier"] = config_warnings(provider)
        else:
            warnings[f"{tier}_tier"] = []
    hivemind = row.get("hivemind_tier_provider") or HIVEMIND_PROVIDER
    if hivemind != HIVEMIND_PROVIDER:
        raise ConfigError(
            "hivemind_tier_provider", f"{hivemind!r}; the hivemind is fixed: {HIVEMIND_PROVIDER}"
        )
    return warnings


def show(folder: Path) -> dict[str, Any] | None:
    """The stored row (credentials as refs only, never keys); None before anything was set."""
    db = _open(folder)
    try:
        names = [r[1] for r in db.execute("PRAGMA table_info(player_llm_config)")]
        row = db.execute(f"SELECT {', '.join(names)} FROM player_llm_config LIMIT 1").fetchone()
    finally:
        db.close()
    if row is None:
        return None
    out = dict(zip(names, row, strict=True))
    out["feature_compat_warnings"] = json.loads(out["feature_compat_warnings"])
    out["lora_backup_enabled"] = bool(out["lora_backup_enabled"])
    return out


def set_config(
    folder: Path, player_id: str, keys: dict[str, str] | None = None, **fields: Any
) -> dict[str, Any]:
    """Set fields of the row (merged over the stored one) and, in ``keys`` (tier: API key), the
    player's BYOK keys, sealed; returns the row as :func:`show` gives it."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
        raise ConfigError(", ".join(unknown), f"unknown player_llm_config fields; known: {', '.join(FIELDS)}")
    old = show(folder) or {}
    if old and old["player_id"] != player_id:
        raise NimmerError(f"{folder / CONFIG_FILE} belongs to player {old['player_id']!r}, not {player_id!r}")
    row = {**{k: old.get(k) for k in FIELDS}, **fields}
    warnings = _check(row)
    now = time.time()
    refs = {f"{t}_tier_credentials_ref": old.get(f"{t}_tier_credentials_ref") for t in TIERS}
    sealed_rows = []
    for tier, key in (keys or {}).items():
        if tier not in TIERS:
            raise ConfigError(
                "keys", f"tier {tier!r}; BYOK keys are for {', '.join(TIERS)} (the hivemind uses ours)"
            )
        if not key:
            raise ConfigError(f"{tier} key", "empty")
        blob, _ = seal(
            key.encode(),
            device_secret(folder),
            {"lora_name": f"byok:{tier}", "lora_version": 0},
            account="device",
            recovery_codes=0,
        )
        ref = str(uuid.uuid4())
        sealed_rows.append((ref, blob.to_bytes(), now))
        refs[f"{tier}_tier_credentials_ref"] = ref
    values = {
        "player_id": player_id,
        **row,
        **refs,
        "hivemind_tier_provider": row.get("hivemind_tier_provider") or "anthropic_via_us",
        "lora_backup_enabled": int(bool(row.get("lora_backup_enabled"))),
        "feature_compat_warnings": json.dumps(warnings, sort_keys=True),
        "configured_at": old.get("configured_at") or now,
        "last_modified": now,
        "lora_backup_last_sync": old.get("lora_backup_last_sync"),
        "lora_encryption_key_ref": old.get("lora_encryption_key_ref"),
    }
    marks = ", ".join("?" * len(values))
    db = _open(folder)
    try:
        with db:
            db.executemany("INSERT INTO byok_credentials VALUES (?, ?, ?)", sealed_rows)
            db.execute("DELETE FROM player_llm_config")
            db.execute(
                f"INSERT INTO player_llm_config ({', '.join(values)}) VALUES ({marks})",
                tuple(values.values()),
            )
            db.execute(
                "DELETE FROM byok_credentials WHERE ref NOT IN (SELECT casual_tier_credentials_ref "
                "FROM player_llm_config WHERE casual_tier_credentials_ref IS NOT NULL UNION SELECT "
                "deep_tier_credentials_ref FROM player_llm_config "
                "WHERE deep_tier_credentials_ref IS NOT NULL)"
            )
    finally:
        db.close()
    return show(folder) or {}


def read_key(folder: Path, ref: str) -> str:
    """The BYOK key behind ``ref``, unsealed with the device's runtime key (the runtime's use only)."""
    db = _open(folder)
    try:
        row = db.execute("SELECT sealed FROM byok_credentials WHERE ref = ?", (ref,)).fetchone()
    finally:
        db.close()
    if row is None:
        raise NimmerError(
            f"no sealed key {ref!r} in {folder / CONFIG_FILE}; set it with nimmer llm-config set"
        )
    return unseal(Sealed.from_bytes(bytes(row[0])), passphrase=device_secret(folder)).decode()


def runtime_row(folder: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """The row for :func:`nimmer_train.runtime.rings.player_rings` and its unsealed keys per tier."""
    row = show(folder)
    if row is None:
        raise NimmerError(f"no LLM configuration in {folder}; set one with nimmer llm-config set")
    keys = {
        t: read_key(folder, row[f"{t}_tier_credentials_ref"])
        for t in TIERS
        if row.get(f"{t}_tier_credentials_ref")
    }
    return row, keys
