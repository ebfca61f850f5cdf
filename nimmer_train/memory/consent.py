"""Consent on the device: the design's player_data_sharing_consent record and the one function
that yields what a contributor may share for training.

Rules of :func:`training_examples`: nothing under opt_out, after revocation, or for a tier other
than the one consented to; only categories the player shared and did not exclude; never the
clasp channel (it reads primary.sqlite only, and drops the clasp category there too); never
the player's id or name (redacted from text and speaker); never an entry whose text holds
several speakers' words (an episode crystal of a transcribed exchange, speaker
:data:`~nimmer_train.memory.entries.EXCHANGE_SPEAKER`): an example is one speaker's words, and
an episode's NPC reply must not leave as the player's (the NPC line is shared, if at all, as its
own write-back entry, under the NPC's name).

The ``nimmer consent`` commands change the record through :func:`grant`, :func:`revoke` and
:func:`exclude`; a training tier needs the device's profile (:data:`PROFILE_FILE`), so granting
one without it is refused at set-up, never discovered mid-round. :func:`takes_part` is the one
test of whether a device joins federated rounds.
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import unicodedata
import uuid
from dataclasses import dataclass
from pathlib import Path

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.errors import NimmerError
from nimmer_train.memory import contributions
from nimmer_train.memory.entries import DATA_CATEGORIES, EXCHANGE_SPEAKER
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
    # the design's remaining columns (schema v5), derived from the tier and the contributions
    anonymization_method: str | None = None
    benefit_tier: str | None = None
    last_contribution_at: float | None = None
    contribution_count: int = 0
    can_request_deletion: bool = True  # A.1: only updates existed; A.2: forward-only deletion

    def __post_init__(self) -> None:
        if self.sharing_tier not in TIERS:
            raise NimmerError(f"sharing_tier {self.sharing_tier!r} is not one of {', '.join(TIERS)}")
        unknown = set(self.data_categories_shared) | set(self.excluded_categories)
        unknown -= set(DATA_CATEGORIES)
        if unknown:
            raise NimmerError(
                f"unknown data categories {sorted(unknown)}; known: {', '.join(DATA_CATEGORIES)}"
            )


# design table "Three opt-in tiers": what each tier does to the data, and what the player gets
ANONYMIZATION = {
    "A1_federated": "federated_dp_updates_only",
    "A2_anonymized": "identifier_scrub_dp_sgd",
    "A3_pseudonymous_full": "pseudonym",
}
BENEFITS = {
    "A1_federated": "backup_discount_badge_early_access",
    "A2_anonymized": "larger_discount_faster_updates_training_priorities",
    "A3_pseudonymous_full": "premium_custom_lora_beta_credits",
}
COLUMNS = (
    "sharing_tier, data_categories_shared, excluded_categories, granted_at, revoked_at, "
    "anonymization_method, benefit_tier, last_contribution_at, contribution_count, can_request_deletion"
)


def get_consent(memory: PlayerMemory) -> ConsentRecord:
    row = memory.primary.execute(f"SELECT {COLUMNS} FROM player_data_sharing_consent WHERE id = 1").fetchone()
    if row is None:
        return ConsentRecord()  # the default is opt-out
    return ConsentRecord(
        row[0], tuple(json.loads(row[1])), tuple(json.loads(row[2])), *row[3:8], int(row[8]), bool(row[9])
    )


def set_consent(memory: PlayerMemory, record: ConsentRecord) -> ConsentRecord:
    """Store ``record`` and return it as stored: the anonymization method and benefit tier
    follow its sharing tier."""
    record = dataclasses.replace(
        record,
        anonymization_method=ANONYMIZATION.get(record.sharing_tier),
        benefit_tier=BENEFITS.get(record.sharing_tier),
    )
    with memory.primary:
        memory.primary.execute(
            f"INSERT OR REPLACE INTO player_data_sharing_consent (id, {COLUMNS}) "
            "VALUES (1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                record.sharing_tier,
                json.dumps(list(record.data_categories_shared)),
                json.dumps(list(record.excluded_categories)),
                record.granted_at,
                record.revoked_at,
                record.anonymization_method,
                record.benefit_tier,
                record.last_contribution_at,
                record.contribution_count,
                int(record.can_request_deletion),
            ),
        )
    return record


def note_contribution(memory: PlayerMemory, now: float | None = None) -> ConsentRecord:
    """Count one contribution (an A.1 round trained in, an A.2 upload sent) on the record."""
    old = get_consent(memory)
    at = now if now is not None else memory.clock()
    record = dataclasses.replace(old, contribution_count=old.contribution_count + 1, last_contribution_at=at)
    return set_consent(memory, record)


def note_device_contribution(device: Path, now: float | None = None) -> ConsentRecord:
    """:func:`note_contribution` for a device folder (the federated client holds a path, not a store)."""
    from nimmer_train.memory.embedding import NoEmbedder

    memory = PlayerMemory(device, NoEmbedder())
    try:
        return note_contribution(memory, now)
    finally:
        memory.close()


def takes_part(record: ConsentRecord, tier: str = "A1_federated") -> str | None:
    """None when the record lets the device take part in ``tier``; else why it does not."""
    if record.revoked_at is not None:
        return f"consent was revoked at {_when(record.revoked_at)}"
    if record.sharing_tier != tier:
        return f"the consent tier is {record.sharing_tier}, not {tier}"
    if not shareable_categories(record, tier):
        return "no data category is shared (every shared one is excluded or never shared)"
    return None


def _when(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


SHAREABLE = tuple(c for c in DATA_CATEGORIES if c not in NEVER_SHARED)


def grant(
    memory: PlayerMemory, tier: str, categories: tuple[str, ...] | None = None, now: float | None = None
) -> ConsentRecord:
    """Consent to ``tier`` now (a fresh grant: any revocation is lifted), sharing ``categories``
    (default: every category but the never-shared ones), keeping the player's exclusions. A
    training tier needs the device's profile."""
    if tier in TRAINING_TIERS and not (memory.folder / PROFILE_FILE).exists():
        raise NimmerError(
            f"{memory.folder / PROFILE_FILE} is missing: {tier} shares data only after redacting the "
            "player's id and name, which the profile holds; pass --player-id and --player-name"
        )
    shared = tuple(categories) if categories is not None else (SHAREABLE if tier != "opt_out" else ())
    never = sorted(set(shared) & NEVER_SHARED)
    if never:
        raise NimmerError(f"categories {never} are never shared (no sync or export path may exist)")
    old = get_consent(memory)
    at = now if now is not None else memory.clock()
    record = dataclasses.replace(
        old, sharing_tier=tier, data_categories_shared=shared, granted_at=at, revoked_at=None
    )
    record = set_consent(memory, record)
    view = consent_view(record)
    contributions.record(
        memory.folder, "consent_granted", at=record.granted_at, tier=tier, shared=view["categories_shared"]
    )
    return record


def revoke(memory: PlayerMemory, now: float | None = None) -> ConsentRecord:
    """Revoke consent now: nothing is shared from here on (the tier is kept, for the record)."""
    old = get_consent(memory)
    if old.revoked_at is not None:
        return old
    record = dataclasses.replace(old, revoked_at=now if now is not None else memory.clock())
    record = set_consent(memory, record)
    contributions.record(memory.folder, "consent_revoked", at=record.revoked_at)  # `nimmer contributions`
    return record


def exclude(memory: PlayerMemory, category: str) -> ConsentRecord:
    """Exclude one data category from sharing, whatever the tier."""
    old = get_consent(memory)
    excluded = tuple(dict.fromkeys([*old.excluded_categories, category]))
    record = dataclasses.replace(old, excluded_categories=excluded)
    return set_consent(memory, record)


def shareable_categories(record: ConsentRecord, tier: str) -> set[str]:
    if tier not in TRAINING_TIERS or record.sharing_tier != tier or record.revoked_at is not None:
        return set()
    return set(record.data_categories_shared) - set(record.excluded_categories) - NEVER_SHARED


def consent_view(record: ConsentRecord) -> dict[str, list[str]]:
    """The categories as :func:`shareable_categories` enforces them, for every place that shows
    consent (``consent show``, ``contribute``, ``memory inspect``): shared is what the filter
    lets leave for the record's tier now (nothing under opt_out or after revocation; never a
    never-shared category such as clasp, never an excluded one), excluded the player's
    exclusions, never_shared what no path may move."""
    shared = shareable_categories(record, record.sharing_tier)
    return {
        "categories_shared": [c for c in DATA_CATEGORIES if c in shared],
        "categories_excluded": [c for c in DATA_CATEGORIES if c in record.excluded_categories],
        "never_shared": sorted(NEVER_SHARED),
    }


def training_examples(
    memory: PlayerMemory, tier: str, player_id: str, player_name: str
) -> list[dict[str, str]]:
    """The player's entries they may share for ``tier``, with their id and name redacted."""
    return [example for _, example in _shareable(memory, tier, player_id, player_name)]


def _shareable(
    memory: PlayerMemory, tier: str, player_id: str, player_name: str
) -> list[tuple[str, dict[str, str]]]:
    """(event_uid, redacted example) of each entry the player may share for ``tier``; the
    event_uid never leaves the device."""
    allowed = shareable_categories(get_consent(memory), tier)
    if not allowed:
        return []
    if not player_id:
        raise NimmerError("training_examples needs the player_id, to keep it out of what is shared")
    pattern = _identifiers(player_id, player_name)
    gone = {  # crystals consolidation forgot (expired) or archived are never shared (issue 16)
        uid
        for (uid,) in memory.primary.execute(
            "SELECT e.event_uid FROM entries e JOIN crystals c ON c.entry_id = e.id "
            "WHERE c.lifecycle IN ('expired', 'archived')"
        )
    }
    out = []
    for entry in memory.entries(categories=sorted(allowed)):
        if entry.event_uid in gone or entry.speaker == EXCHANGE_SPEAKER:
            continue
        text, speaker = _fold(entry.text), _fold(entry.speaker)
        speaker = PLAYER if pattern.fullmatch(speaker) else speaker
        out.append(
            (
                entry.event_uid,
                {
                    "text": pattern.sub(PLAYER, text),
                    "speaker": pattern.sub(PLAYER, speaker),
                    "data_category": entry.data_category,
                    "semantic_type": entry.semantic_type,
                    "memory_class": entry.memory_class,
                },
            )
        )
    return out


def _fold(text: str) -> str:
    """``text`` in one spelling, so an identifier cannot slip past redaction by its encoding:
    NFKC (composed accents, full-width and compatibility forms), invisible format characters
    (zero-width spaces and joiners, soft hyphens) dropped, every dash a plain hyphen."""
    text = unicodedata.normalize("NFKC", text)
    return "".join(
        "-" if unicodedata.category(c) == "Pd" else c for c in text if unicodedata.category(c) != "Cf"
    )


def _identifiers(*names: str) -> re.Pattern[str]:
    """The player's id and name, folded, case-insensitively, longest first; a separator in
    them (hyphen, underscore, dot, space) matches any one of those, or none."""
    folded = sorted({_fold(n) for n in names if n}, key=len, reverse=True)
    flexible = [re.sub(r"(?:\\[-_. ]|_)", r"[-_.\\s]?", re.escape(n)) for n in folded]
    return re.compile("|".join(flexible), re.I)


PROFILE_FILE = "profile.json"  # the device's own record of who plays on it; never leaves the device


def write_profile(folder: Path, player_id: str, player_name: str) -> None:
    write_json_atomic(  # the player's real id and name: the device's owner only
        folder / PROFILE_FILE, {"player_id": player_id, "player_name": player_name}, private=True
    )


def read_profile(folder: Path) -> tuple[str, str]:
    """(player_id, player_name) of the player on this device, for redaction before sharing."""
    path = folder / PROFILE_FILE
    if not path.exists():
        raise NimmerError(
            f"{path} is missing: the device needs its player's profile to redact shared data; "
            f"`nimmer consent set TIER {folder} --player-id ID --player-name NAME` writes it"
        )
    data = json.loads(path.read_text())
    return data["player_id"], data["player_name"]


def existing_contributor_id(memory: PlayerMemory) -> str | None:
    """The contributor id if this device has made one (never makes one)."""
    row = memory.primary.execute("SELECT contributor_id FROM contributor WHERE id = 1").fetchone()
    return row[0] if row else None


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
    """The next anonymised A.2 upload from this device (None when consent yields nothing new);
    its random id is remembered locally so the player can later ask for its deletion. An entry
    goes into one upload only, ever: a second upload does not repeat the first (the pool's
    record-level accounting counts each example once), and what the player asked forgotten is
    never sent again. Which entries went where stays in the device's contributions log."""
    sent = contributions.a2_sent_entries(memory.folder)
    fresh = [
        (uid, example)
        for uid, example in _shareable(memory, "A2_anonymized", player_id, player_name)
        if uid not in sent
    ]
    if not fresh:
        return None
    upload = anonymize([example for _, example in fresh], player_id, player_name, other_names)
    with memory.primary:
        memory.primary.execute(
            "INSERT INTO a2_uploads VALUES (?, ?, NULL)", (upload.upload_id, memory.clock())
        )
    note_contribution(memory)
    contributions.record(
        memory.folder,
        "a2_upload",
        upload_id=upload.upload_id,
        examples=len(upload.examples),
        entries=[uid for uid, _ in fresh],
    )
    return upload


def sent_uploads(memory: PlayerMemory, pending_only: bool = False) -> list[str]:
    """Ids of the A.2 uploads this device sent (``pending_only``: those not yet asked deleted)."""
    where = " WHERE deletion_requested_at IS NULL" if pending_only else ""
    query = f"SELECT upload_id FROM a2_uploads{where} ORDER BY sent_at, upload_id"
    return [r[0] for r in memory.primary.execute(query)]


def request_deletion(
    memory: PlayerMemory, now: float | None = None, ids: list[str] | None = None
) -> list[str]:
    """Mark every sent upload not yet asked deleted (or those of ``ids``) as asked
    (``deletion_requested_at``); returns their ids, for the deletion request the operator's
    intake applies."""
    ids = sent_uploads(memory, pending_only=True) if ids is None else ids
    at = now if now is not None else memory.clock()
    with memory.primary:
        memory.primary.executemany(
            "UPDATE a2_uploads SET deletion_requested_at = ? WHERE upload_id = ?", [(at, i) for i in ids]
        )
    return ids
