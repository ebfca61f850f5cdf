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
from dataclasses import dataclass
from pathlib import Path

from nimmer_train.artifacts import MANIFEST
from nimmer_train.errors import NimmerError
from nimmer_train.publish.manifest import SIGNATURE, IntegrityError
from nimmer_train.publish.registry import REGISTRY_FILE, Registry
from nimmer_train.publish.signing import Keyring

MAX_BYTES = 16 << 20  # a manifest or signature above this is refused unread (as a pull does)


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
    registry = Registry.open(releases)
    try:
        rows = [
            (v.label, int(v.row["version_number"]), str(v.row["manifest_sha256"]))
            for v in registry.versions()
        ]
    finally:
        registry.close()
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
    manifest = json.loads(raw)
    if not isinstance(manifest, dict) or manifest.get("version_label") != label:
        raise IntegrityError(f"{folder / MANIFEST} is not {label}'s manifest; refused")
    merged = manifest.get("merged_adapter")
    if not isinstance(merged, dict) or not isinstance(merged.get("federation_id"), str):
        return None  # no federation in it, or published before versions named their federation
    rounds = merged.get("rounds_released")
    done = merged.get("rounds_done")
    if (
        not isinstance(rounds, list)
        or not all(type(r) is int for r in rounds)
        or not (done is None or type(done) is int)
    ):
        raise IntegrityError(f"{label}: merged_adapter.rounds_released/rounds_done are not round numbers")
    eps, delta = merged.get("epsilon_a1_user_level"), merged.get("delta")
    return FederationRelease(
        merged["federation_id"],
        label,
        number,
        str(manifest.get("version_id")),
        digest,
        key_id,
        tuple(sorted(rounds)),
        done,
        float(eps) if type(eps) in (int, float) else None,  # a bool is no epsilon
        float(delta) if type(delta) in (int, float) else None,
    )
