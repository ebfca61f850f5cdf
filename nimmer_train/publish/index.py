"""A mirror's signed index of its versions, so a device can pull ``newest`` or an alias
(``production``, ``candidate``) from a mirror without knowing the exact version URL.

``releases/index.json`` is one file, replaced atomically: ``{"index": {...}, "signature": {...}}``,
the signature (the publisher's manifest key, ``publish/signing.py``) over the index's canonical
bytes (``manifest_bytes``: sorted keys, so a reader re-serialises what it parsed and verifies
exactly what it will use). The index holds its ``format``, an ``index_id`` made once per releases
folder, a ``sequence`` one higher at every write, ``issued_at`` and ``expires_at`` (issued_at plus
the releases folder's validity, :data:`VALIDITY_DAYS` unless ``nimmer versions sign-index
--validity-days`` set another), every version (label, version id, number, the sha256 of its
signed manifest), the aliases and the newest label. Publish writes it after it commits (and
promotes), ``nimmer versions promote`` after it moves an alias, and ``nimmer versions
sign-index`` re-signs it unchanged but for its sequence and dates: the publisher runs it well
within the validity (daily, say), so a live mirror never serves an expired index.

A reader trusts it no further than the signature: :func:`read_index` verifies it against the
trusted keys and checks its shape; a pull (``publish/pull.py``) then refuses an expired index (a
frozen mirror: :func:`expired`), an index under another ``index_id`` than the one the device
pinned at its first pull from this publisher (another releases folder, or an old one re-served to
roll ``newest`` back), an index whose sequence is lower than one this device already read, and a
manifest whose sha256 is not the one the index names.
"""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import write_bytes_atomic
from nimmer_train.errors import NimmerError
from nimmer_train.publish.manifest import IntegrityError, manifest_bytes
from nimmer_train.publish.registry import PREFIX, Registry
from nimmer_train.publish.signing import Keyring, load_private, sign

INDEX = "index.json"
INDEX_FORMAT = "nimmerworld-release-index/1"
NEWEST = "newest"
MAX_INDEX_BYTES = 16 << 20  # like a manifest: refused unread above this
ID_SETTING, SEQUENCE_SETTING = "index_id", "index_sequence"  # the publisher's registry settings
SEEN_SETTING = "mirror_index_sequence:"  # + index_id: the highest sequence a device has read
PIN_SETTING = "mirror_index_id"  # the publisher's index_id a device pinned at its first mirror pull
ISSUED_SETTING = "mirror_index_issued_at"  # the latest issued_at among the indexes a device read
VALIDITY_SETTING = "index_validity_days"  # the publisher's: how long an index it signs is valid
VALIDITY_DAYS = 14.0  # the default: a mirror frozen longer than this is detected
LABEL_RE = re.compile(rf"{PREFIX}(\d+)")
SHA_RE = re.compile(r"[0-9a-f]{64}")


def write_index(releases: Path, signing_key: Path, validity_days: float | None = None) -> dict[str, Any]:
    """Sign and write ``releases/index.json`` from the registry as it is now (under its write
    lock, so two writers cannot give one sequence twice); returns the index. ``validity_days``:
    kept as the releases folder's validity from now on (None: the one kept, else
    :data:`VALIDITY_DAYS`)."""
    key = load_private(signing_key)
    if validity_days is not None and not 0 < validity_days <= 3650:
        raise NimmerError(f"index validity {validity_days} days: give a number of days in (0, 3650]")
    registry = Registry.open(releases)
    try:
        with registry.writing():
            index_id = registry.setting(ID_SETTING) or str(uuid.uuid4())
            sequence = int(registry.setting(SEQUENCE_SETTING) or 0) + 1
            if validity_days is not None:
                registry.set_setting(VALIDITY_SETTING, repr(float(validity_days)))
            days = float(registry.setting(VALIDITY_SETTING) or VALIDITY_DAYS)
            issued = datetime.now(UTC).replace(microsecond=0)
            versions = [
                {
                    "label": v.label,
                    "version_id": v.id,
                    "version_number": int(v.row["version_number"]),
                    "manifest_sha256": v.row["manifest_sha256"],
                }
                for v in registry.versions()
            ]
            index = {
                "format": INDEX_FORMAT,
                "index_id": index_id,
                "sequence": sequence,
                "issued_at": issued.isoformat(),
                "expires_at": (issued + timedelta(days=days)).isoformat(),
                "versions": versions,
                "aliases": dict(sorted(registry.aliases().items())),
                "newest": versions[-1]["label"] if versions else None,
            }
            raw = manifest_bytes(index)
            envelope = {"index": index, "signature": sign(raw, key)}
            write_bytes_atomic(
                releases / INDEX, (json.dumps(envelope, indent=2, sort_keys=True) + "\n").encode()
            )
            registry.set_setting(ID_SETTING, index_id)
            registry.set_setting(SEQUENCE_SETTING, str(sequence))
    finally:
        registry.close()
    return index


def read_index(data: bytes, keyring: Keyring, where: str) -> tuple[dict[str, Any], str]:
    """The verified index in ``data`` (fetched from ``where``) and the key id that signed it;
    :class:`IntegrityError` or ``SignatureError`` naming ``where`` otherwise."""
    try:
        envelope = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise IntegrityError(
            f"{where} is not a readable signed index ({type(exc).__name__}); refused"
        ) from exc
    if not isinstance(envelope, dict) or sorted(envelope) != ["index", "signature"]:
        raise IntegrityError(
            f"{where} is not a signed index (expected the fields index and signature); refused"
        )
    index = envelope["index"]
    if not isinstance(index, dict):
        raise IntegrityError(f"{where}: its index is not a JSON object; refused")
    key_id = keyring.verify(manifest_bytes(index), envelope["signature"], f"the mirror's index {where}")
    _check_shape(index, where)
    return index, key_id


def _check_shape(index: dict[str, Any], where: str) -> None:
    """A signed index this reader understands: the format, its id and sequence, versions with a
    label and a manifest sha256 each, aliases naming listed versions, newest the highest listed."""
    if index.get("format") != INDEX_FORMAT:
        raise IntegrityError(
            f"{where}: index format {index.get('format')!r}, this client reads {INDEX_FORMAT}"
        )
    seq = index.get("sequence")
    if not isinstance(index.get("index_id"), str) or type(seq) is not int or seq < 1:
        raise IntegrityError(f"{where}: the index has no index_id or no positive integer sequence")
    if _when(index.get("issued_at")) is None:
        raise IntegrityError(f"{where}: the index's issued_at {index.get('issued_at')!r} is not a UTC time")
    if "expires_at" in index and _when(index["expires_at"]) is None:
        raise IntegrityError(f"{where}: the index's expires_at {index['expires_at']!r} is not a UTC time")
    versions = index.get("versions")
    if not isinstance(versions, list) or not all(
        isinstance(v, dict)
        and isinstance(v.get("label"), str)
        and LABEL_RE.fullmatch(v["label"])
        and isinstance(v.get("manifest_sha256"), str)
        and SHA_RE.fullmatch(v["manifest_sha256"])
        for v in versions
    ):
        raise IntegrityError(f"{where}: the index's versions are not a list of {{label, manifest_sha256}}")
    labels = {v["label"] for v in versions}
    aliases = index.get("aliases")
    if not isinstance(aliases, dict) or not all(
        isinstance(a, str) and v in labels for a, v in aliases.items()
    ):
        raise IntegrityError(f"{where}: the index's aliases must each name a version it lists")
    highest = max(labels, key=lambda label: int(label.rsplit("v", 1)[1]), default=None)
    if index.get("newest") != highest:  # what write_index writes: a newest that is not the max lies
        raise IntegrityError(
            f"{where}: the index's newest {index.get('newest')!r} is not the highest version it "
            f"lists ({highest}); refused"
        )


def resolve(index: dict[str, Any], selector: str, where: str) -> dict[str, Any]:
    """The index's entry for ``selector``: ``newest``, ``vN``/``nimmerworld-base-vN`` or an alias."""
    by_label = {v["label"]: v for v in index["versions"]}
    if selector == NEWEST:
        if index.get("newest") is None:
            raise NimmerError(f"the mirror's index {where} lists no version yet; nothing to pull")
        return by_label[index["newest"]]
    short = re.fullmatch(r"v(\d+)", selector)
    label = f"{PREFIX}{short.group(1)}" if short else selector
    if LABEL_RE.fullmatch(label):
        if label not in by_label:
            listed = ", ".join(by_label) or "none"
            raise NimmerError(f"the mirror's index {where} has no version {selector!r}; it lists: {listed}")
        return by_label[label]
    aliases = index["aliases"]
    if selector not in aliases:
        known = ", ".join(sorted(aliases)) or "none"
        raise NimmerError(
            f"the mirror's index {where} has no alias {selector!r} (its aliases: {known}); "
            f"give one of them, {NEWEST} or vN"
        )
    return by_label[aliases[selector]]


def _when(value: Any) -> datetime | None:
    """An ISO time with its UTC offset, as write_index writes it; None for anything else."""
    if not isinstance(value, str):
        return None
    try:
        at = datetime.fromisoformat(value)
    except ValueError:
        return None
    return at if at.tzinfo is not None else None


def expired(index: dict[str, Any], now: datetime | None = None) -> str | None:
    """Why a verified index may no longer be believed for what is newest (a frozen mirror keeps
    serving it): past its ``expires_at``, or without one (signed before indexes expired); None
    while it is valid."""
    until = _when(index.get("expires_at"))
    if until is None:
        return "it has no expires_at (signed before indexes expired)"
    now = now or datetime.now(UTC)
    if now >= until:
        return f"it expired at {index['expires_at']} (issued {index['issued_at']})"
    return None
