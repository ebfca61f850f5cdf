"""What a memory is: the entry record, its vocabularies and validation, and the SQL schema that
every memory store (primary, fallback, clasp) shares."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from nimmer_train.errors import NimmerError
from nimmer_train.voice.traits import check_vector

MEMORY_CLASSES = ("cornerstone", "birthright", "working", "volatile")
SEMANTIC_TYPES = (
    "fact",
    "preference",
    "task_pattern",
    "skill",
    "episode",
    "insight",
    "relationship",
    "goal",
    "general",
)
DATA_CATEGORIES = (
    "casual_dialog",
    "clasp",
    "liminal_wallreads",
    "memorial_archive",
    "imperial_net_session",
    "companion_session",
    "dream_content",
    "aletheia_progression",
)
EMBEDDING_DIM = 384

COLUMNS = (
    "event_uid",
    "text",
    "speaker",
    "created_at",
    "updated_at",
    "memory_class",
    "semantic_type",
    "trait_engagement",
    "emotional_valence",
    "access_count",
    "last_access",
    "importance",
    "source_ids",
    "data_category",
    "session_id",
)


class InvalidEntry(NimmerError):
    """An entry that cannot be stored; the message names the field. Nothing was written."""


# The speaker of an episode whose text holds several speakers' lines (a player line and an NPC
# reply): no one person said it, so consent's training export never shares it as anyone's words.
EXCHANGE_SPEAKER = "exchange"


@dataclass(frozen=True)
class MemoryEntry:
    event_uid: str
    text: str
    speaker: str
    memory_class: str
    data_category: str
    semantic_type: str = "general"
    trait_engagement: dict[str, float] = field(default_factory=dict)  # +1/0/-1 grammar with strengths
    emotional_valence: float = 0.0
    importance: float = 0.5
    source_ids: tuple[str, ...] = ()
    session_id: str | None = None
    created_at: float = 0.0
    updated_at: float = 0.0
    access_count: int = 0
    last_access: float | None = None

    def row(self) -> tuple[Any, ...]:
        values = {
            **self.__dict__,
            "trait_engagement": json.dumps(self.trait_engagement, sort_keys=True),
            "source_ids": json.dumps(list(self.source_ids)),
        }
        return tuple(values[c] for c in COLUMNS)

    @classmethod
    def from_row(cls, row: tuple[Any, ...]) -> MemoryEntry:
        values = dict(zip(COLUMNS, row, strict=True))
        values["trait_engagement"] = json.loads(values["trait_engagement"])
        values["source_ids"] = tuple(json.loads(values["source_ids"]))
        return cls(**values)


def clean_text(text: str | bytes, max_chars: int) -> str:
    """The entry text, or InvalidEntry for empty, oversized or invalid UTF-8 input."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidEntry(f"text: invalid UTF-8 at byte {exc.start}") from exc
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidEntry(f"text: not encodable as UTF-8 at character {exc.start} (lone surrogate)") from exc
    if not text.strip():
        raise InvalidEntry("text: empty")
    if len(text) > max_chars:
        raise InvalidEntry(f"text: {len(text)} characters, over the limit of {max_chars} (memory.max_chars)")
    return text


def validate(entry: MemoryEntry) -> None:
    if entry.memory_class not in MEMORY_CLASSES:
        raise InvalidEntry(f"memory_class: {entry.memory_class!r} is not one of {', '.join(MEMORY_CLASSES)}")
    if entry.data_category not in DATA_CATEGORIES:
        raise InvalidEntry(
            f"data_category: {entry.data_category!r} is not one of {', '.join(DATA_CATEGORIES)}"
        )
    if entry.semantic_type not in SEMANTIC_TYPES:
        raise InvalidEntry(
            f"semantic_type: {entry.semantic_type!r} is not one of {', '.join(SEMANTIC_TYPES)}"
        )
    if not entry.event_uid or not entry.speaker:
        raise InvalidEntry("event_uid and speaker must not be empty")
    if not -1 <= entry.emotional_valence <= 1:
        raise InvalidEntry(f"emotional_valence: {entry.emotional_valence} is outside [-1, 1]")
    if not 0 <= entry.importance <= 1:
        raise InvalidEntry(f"importance: {entry.importance} is outside [0, 1]")
    try:
        check_vector(entry.trait_engagement, "trait_engagement")
    except ValueError as exc:
        raise InvalidEntry(str(exc)) from exc
