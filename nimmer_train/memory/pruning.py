"""Pruning: decay(age, trait_engagement_vector, class), deterministic for an injected clock.

- cornerstone: never pruned;
- birthright: locked at creation, never pruned;
- working: retention = importance * 0.5 ** (age_hours / half_life), where the half-life grows
  with trait engagement: half_life = base_half_life_h * (1 + engagement_boost * engagement) and
  engagement = mean |strength| over the entry's trait axes (the +1/0/-1 grammar with strengths).
  Entries below ``min_retention`` are pruned: old, unimportant, trait-neutral memories go first;
- volatile: session-bounded, pruned once their session is not the current one.

On a character's death: its working and volatile memories go; cornerstone and birthright stay
(the memorial keeps what mattered).
"""

from __future__ import annotations

from dataclasses import dataclass

from nimmer_train.memory.entries import MemoryEntry
from nimmer_train.memory.player_memory import PlayerMemory


@dataclass(frozen=True)
class DecayPolicy:
    base_half_life_h: float = 24 * 14
    engagement_boost: float = 3.0
    min_retention: float = 0.05


def retention(entry: MemoryEntry, now: float, policy: DecayPolicy) -> float:
    """How much of a working memory remains at ``now`` (1.0 for classes that do not decay)."""
    if entry.memory_class != "working":
        return 1.0
    strengths = [abs(v) for v in entry.trait_engagement.values()]
    engagement = sum(strengths) / len(strengths) if strengths else 0.0
    half_life = policy.base_half_life_h * (1 + policy.engagement_boost * engagement)
    age_h = max(0.0, now - entry.created_at) / 3600
    return entry.importance * 0.5 ** (age_h / half_life)


def decayed(entry: MemoryEntry, now: float, current_session: str | None, policy: DecayPolicy) -> bool:
    if entry.memory_class == "volatile":
        return entry.session_id != current_session
    return entry.memory_class == "working" and retention(entry, now, policy) < policy.min_retention


def to_prune(
    entries: list[MemoryEntry], now: float, current_session: str | None, policy: DecayPolicy
) -> list[str]:
    """The event_uids a prune pass removes, in a stable order."""
    return sorted(e.event_uid for e in entries if decayed(e, now, current_session, policy))


def prune(
    memory: PlayerMemory, current_session: str | None, policy: DecayPolicy = DecayPolicy()
) -> list[str]:
    """Remove what decayed from primary, in one transaction; return the removed event_uids."""
    gone = to_prune(memory.entries(), memory.clock(), current_session, policy)
    memory.delete(gone)
    return gone


def on_character_death(memory: PlayerMemory, character: str) -> list[str]:
    """Remove the dead character's working and volatile memories; keep cornerstone and birthright."""
    gone = sorted(
        e.event_uid
        for e in memory.entries()
        if e.speaker == character and e.memory_class in ("working", "volatile")
    )
    memory.delete(gone)
    return gone
