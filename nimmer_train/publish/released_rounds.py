"""Which federation rounds each version in a releases folder released, read from its signed
manifest (``merged_adapter``: ``federation_id``, ``rounds_released``, ``rounds_done``, the A.1
epsilon and delta), so a device that left a federation early and never heard the server's
outcome still learns what became of its rounds (``nimmer contributions``).

Nothing is believed before the signature: each registered version's ``manifest.json`` must verify
against the trusted keys and hash to the sha256 the registry recorded when it was published or
pulled here; a version that fails is reported (refused) and contributes nothing. The files
themselves are not re-hashed: the claim lives in the manifest alone.
"""

from __future__ import annotations

import hashlib
import json
import math
import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import MANIFEST
from nimmer_train.errors import NimmerError
from nimmer_train.publish.manifest import SIGNATURE, IntegrityError
from nimmer_train.publish.registry import REGISTRY_FILE, Registry, label_of
from nimmer_train.publish.signing import Keyring

MAX_BYTES = 16 << 20  # a manifest or signature above this is refused unread (as a pull does)
MAX_ROUND = 10**9  # a round number above this is no round (and would overflow a float)


@dataclass(frozen=True)
class FederationRelease:
    """One signed version's word on one federation: the rounds it released and its epsilon."""

    federation_id: str
    label: str
    version_number: int
    version_id: str
    manifest_sha256: str
    key_id: str
    rounds_released: tuple[int, ...]
    rounds_done: int | None  # None: a manifest that does not say (all its federation's rounds)
    epsilon_a1_user_level: float | None
    delta: float | None


def federation_releases(releases: Path, keyring: Keyring) -> tuple[list[FederationRelease], list[str]]:
    """(what every verified version of ``releases`` says of its federation, one line per version
    refused: its signature or its recorded sha256 fails, or its manifest is unreadable). A folder
    without a registry holds no version: ([], [])."""
    if not (releases / REGISTRY_FILE).exists():
        return [], []
    try:
        rows = _rows(releases)
    except (sqlite3.DatabaseError, ValueError, TypeError, KeyError) as exc:  # corrupt or foreign
        return [], [f"{releases / REGISTRY_FILE}: not a readable version registry ({exc})"]
    found, refused = [], []
    for label, number, recorded in rows:
        try:
            claim = _claim(releases / label, label, number, recorded, keyring)
        except NimmerError as exc:
            refused.append(f"{label}: {exc}")
            continue
        if claim is not None:
            found.append(claim)
    return found, refused


def _rows(releases: Path) -> list[tuple[str, int, str]]:
    """(label, number, manifest sha256) of every registered version."""
    registry = Registry.open(releases)
    try:
        return [
            (v.label, int(v.row["version_number"]), str(v.row["manifest_sha256"]))
            for v in registry.versions()
        ]
    finally:
        registry.close()


def _read(path: Path) -> bytes:
    if path.is_symlink() or not path.is_file():
        raise IntegrityError(f"{path} is missing or not a regular file")
    if path.stat().st_size > MAX_BYTES:
        raise IntegrityError(f"{path} is larger than {MAX_BYTES} bytes; refused unread")
    return path.read_bytes()


def _claim(
    folder: Path, label: str, number: int, recorded: str, keyring: Keyring
) -> FederationRelease | None:
    """The federation ``folder``'s signed manifest names, after its checks; None when it names none."""
    raw, sig_raw = _read(folder / MANIFEST), _read(folder / SIGNATURE)
    try:
        signature = json.loads(sig_raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{folder / SIGNATURE} is not readable JSON; refused") from exc
    key_id = keyring.verify(raw, signature, str(folder / MANIFEST))
    digest = hashlib.sha256(raw).hexdigest()
    if digest != recorded:
        raise IntegrityError(
            f"{folder / MANIFEST} (sha256 {digest[:12]}) is not the manifest registered for {label} "
            f"({recorded[:12]}); refused"
        )
    try:
        manifest = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise IntegrityError(f"{folder / MANIFEST} is not readable JSON; refused") from exc
    if not isinstance(manifest, dict) or manifest.get("version_label") != label:
        raise IntegrityError(f"{folder / MANIFEST} is not {label}'s manifest; refused")
    if label != label_of(number):  # a copied registry renumbering a signed version (who released first)
        raise IntegrityError(f"{label} is registered as number {number}, not its label's; refused")
    merged = manifest.get("merged_adapter")
    if not isinstance(merged, dict) or merged.get("federation_id") is None:
        return None  # no federation in it, or published before versions named their federation
    rounds, done, eps, delta = _checked(merged, label)
    return FederationRelease(
        merged["federation_id"],
        label,
        number,
        str(manifest.get("version_id")),
        digest,
        key_id,
        rounds,
        done,
        eps,
        delta,
    )


def _number(value: Any, low: float, high: float, finite: bool) -> bool:
    """A JSON number (not a bool) in [low, high]; NaN never, infinity only when not ``finite``."""
    if type(value) not in (int, float) or (isinstance(value, float) and math.isnan(value)):
        return False
    if finite and isinstance(value, float) and math.isinf(value):
        return False
    return low <= value <= high


def _checked(
    merged: dict[str, Any], label: str
) -> tuple[tuple[int, ...], int | None, float | None, float | None]:
    """(rounds released, rounds_done, epsilon, delta) of a signed merged_adapter, or IntegrityError
    naming the field: a figure that is not one would make a device show less spend than it has
    (``max(0.0, nan)`` is 0.0) or break every later ``nimmer contributions``."""
    fid, rounds, done = merged["federation_id"], merged.get("rounds_released"), merged.get("rounds_done")
    eps, delta = merged.get("epsilon_a1_user_level"), merged.get("delta")
    where = f"{label}: merged_adapter"
    if not isinstance(fid, str) or not 0 < len(fid) <= 200:
        raise IntegrityError(f"{where}.federation_id {fid!r:.60} is not a federation id; refused")
    if not isinstance(rounds, list) or not all(type(r) is int and 1 <= r <= MAX_ROUND for r in rounds):
        raise IntegrityError(
            f"{where}.rounds_released {rounds!r:.60} is not a list of round numbers 1..{MAX_ROUND}; refused"
        )
    if done is not None and not (type(done) is int and max(rounds, default=0) <= done <= MAX_ROUND):
        raise IntegrityError(
            f"{where}.rounds_done {done!r:.60} is not a round number from its last released round to "
            f"{MAX_ROUND}; refused"
        )
    if eps is not None and not _number(eps, 0.0, math.inf, finite=False):
        raise IntegrityError(f"{where}.epsilon_a1_user_level {eps!r:.60} is not an epsilon >= 0; refused")
    if delta is not None and not _number(delta, 0.0, 1.0, finite=True):
        raise IntegrityError(f"{where}.delta {delta!r:.60} is not a delta in [0, 1]; refused")
    return (
        tuple(sorted(rounds)),
        done,
        None if eps is None else float(eps),
        None if delta is None else float(delta),
    )
