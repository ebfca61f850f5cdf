"""Consent on the device: the design's player_data_sharing_consent record and the one function
that yields what a contributor may share for training.

Rules of :func:`training_examples`: nothing under opt_out, after revocation, or for a tier other
than the one consented to; only categories the player shared and did not exclude; never the
clasp channel (it reads primary.sqlite only, and drops the clasp category there too); never
the player's id or name (redacted from text and speaker).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.errors import NimmerError
from nimmer_train.memory.entries import DATA_CATEGORIES
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.privacy.anonymize import Upload, anonymize

TIERS = ("opt_out", "A1_federated", "A2_anonymized", "A3_pseudonymous_full")
TRAINING_TIERS = ("A1_federated", "A2_anonymized")  # A3 is not in scope for training yet
NEVER_SHARED = frozenset({"clasp"})
PLAYER = "[player]"


@dataclass(frozen=True)
class ConsentRecord:
    sharing_tier: str = "opt_out"
    data_categories_shared: tuple[str, ...] = ()
    excluded_categories: tuple[str, ...] = ()
    granted_at: float | None = None
    revoked_at: float | None = None

    def __post_init__(self) -> None:
        if self.sharing_tier not in TIERS:
            raise NimmerError(f"sharing_tier {self.sharing_tier!r} is not one of {', '.join(TIERS)}")
        unknown = set(self.data_categories_shared) | set(self.excluded_categories)
        unknown -= set(DATA_CATEGORIES)
        if unknown:
            raise NimmerError(
                f"unknown data categories {sorted(unknown)}; known: {', '.join(DATA_CATEGORIES)}"
            )


def get_consent(memory: PlayerMemory) -> ConsentRecord:
    row = memory.primary.execute(
        "SELECT sharing_tier, data_categories_shared, excluded_categories, granted_at, revoked_at "
        "FROM player_data_sharing_consent WHERE id = 1"
    ).fetchone()
    if row is None:
        return ConsentRecord()  # the default is opt-out
    return ConsentRecord(row[0], tuple(json.loads(row[1])), tuple(json.loads(row[2])), row[3], row[4])


def set_consent(memory: PlayerMemory, record: ConsentRecord) -> None:
    with memory.primary:
        memory.primary.execute(
            "INSERT OR REPLACE INTO player_data_sharing_consent VALUES (1, ?, ?, ?, ?, ?)",
            (
                record.sharing_tier,
                json.dumps(list(record.data_categories_shared)),
                json.dumps(list(record.excluded_categories)),
                record.granted_at,
                record.revoked_at,
            ),
        )


def shareable_categories(record: ConsentRecord, tier: str) -> set[str]:
    if tier not in TRAINING_TIERS or record.sharing_tier != tier or record.revoked_at is not None:
        return set()
    return set(record.data_categories_shared) - set(record.excluded_categories) - NEVER_SHARED


def training_examples(
    memory: PlayerMemory, tier: str, player_id: str, player_name: str
) -> list[dict[str, str]]:
    """The player's entries they may share for ``tier``, with their id and name redacted."""
    allowed = shareable_categories(get_consent(memory), tier)
    if not allowed:
        return []
    if not player_id:
        raise NimmerError("training_examples needs the player_id, to keep it out of what is shared")
    names = [n for n in (player_id, player_name) if n]
    pattern = re.compile("|".join(re.escape(n) for n in sorted(names, key=len, reverse=True)), re.I)
    out = []
    for entry in memory.entries(categories=sorted(allowed)):
        speaker = PLAYER if pattern.fullmatch(entry.speaker) else entry.speaker
        out.append(
            {
                "text": pattern.sub(PLAYER, entry.text),
                "speaker": pattern.sub(PLAYER, speaker),
                "data_category": entry.data_category,
                "semantic_type": entry.semantic_type,
                "memory_class": entry.memory_class,
            }
        )
    return out


PROFILE_FILE = "profile.json"  # the device's own record of who plays on it; never leaves the device


def write_profile(folder: Path, player_id: str, player_name: str) -> None:
    write_json_atomic(folder / PROFILE_FILE, {"player_id": player_id, "player_name": player_name})


def read_profile(folder: Path) -> tuple[str, str]:
    """(player_id, player_name) of the player on this device, for redaction before sharing."""
    path = folder / PROFILE_FILE
    if not path.exists():
        raise NimmerError(f"{path} is missing: the device needs its player's profile to redact shared data")
    data = json.loads(path.read_text())
    return data["player_id"], data["player_name"]


def contributor_id(memory: PlayerMemory) -> str:
    """This device's pseudonymous contributor id: random (uuid4), made once, kept beside the
    consent record, never derived from the player_id."""
    row = memory.primary.execute("SELECT contributor_id FROM contributor WHERE id = 1").fetchone()
    if row:
        return row[0]
    new = str(uuid.uuid4())
    with memory.primary:
        memory.primary.execute("INSERT INTO contributor VALUES (1, ?, ?)", (new, memory.clock()))
    return new


def a2_upload(
    memory: PlayerMemory, player_id: str, player_name: str, other_names: tuple[str, ...] = ()
) -> Upload | None:
    """The next anonymised A.2 upload from this device (None when consent yields nothing); its
    random id is remembered locally so the player can later ask for its deletion."""
    examples = training_examples(memory, "A2_anonymized", player_id, player_name)
    if not examples:
        return None
    upload = anonymize(examples, player_id, player_name, other_names)
    with memory.primary:
        memory.primary.execute(
            "INSERT INTO a2_uploads VALUES (?, ?, NULL)", (upload.upload_id, memory.clock())
        )
    return upload


def sent_uploads(memory: PlayerMemory) -> list[str]:
    return [
        r[0] for r in memory.primary.execute("SELECT upload_id FROM a2_uploads ORDER BY sent_at, upload_id")
    ]
