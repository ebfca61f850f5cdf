"""Seeded synthetic players: plausible entries across every memory class and data category,
clasp writes in the in-between, a consent record, canon over a small district graph and
companion sessions. For tests, the demo and the federated simulation."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.errors import NimmerError
from nimmer_train.memory.canon import Canon, add_canon, set_districts
from nimmer_train.memory.companion import GOODS_TYPES, open_companion, record_session
from nimmer_train.memory.consent import (
    NEVER_SHARED,
    PLAYER,
    PROFILE_FILE,
    ConsentRecord,
    get_consent,
    read_profile,
    set_consent,
    write_profile,
)
from nimmer_train.memory.embedding import Embedder
from nimmer_train.memory.entries import DATA_CATEGORIES, SEMANTIC_TYPES
from nimmer_train.memory.player_memory import PRIMARY_FILE, Mode, PlayerMemory
from nimmer_train.voice.traits import TRAIT_AXES

NPCS = ("npc:preacher-oran", "npc:scavenger-marra", "npc:chorus-leader", "npc:warden-tess", "npc:ferry-ilse")
PLACES = (
    "the east gate",
    "the lower-ring cisterns",
    "the scrap fields",
    "the bronze gate",
    "the memorial wall",
    "the ration line",
    "the ferry stairs",
)
THINGS = (
    "a copper coil",
    "three bolts",
    "a ribbon",
    "the curfew bell",
    "a sealed letter",
    "a water token",
    "the old map",
)
VERBS = ("saw", "lost", "traded", "hid", "found", "promised", "remembered")
TEMPLATES = {
    "casual_dialog": "{npc} said {name} {verb} {thing} near {place}.",
    "clasp": "In the in-between {npc} whispered that they {verb} {thing} at {place} and never told anyone.",
    "liminal_wallreads": "Words scratched on {place}: whoever {verb} {thing} will be remembered.",
    "memorial_archive": "The archive at {place} records that {npc} {verb} {thing} before the purge.",
    "imperial_net_session": "On the imperial net {name} searched for {thing} and the feed showed {place}.",
    "companion_session": "A companion from {place} listened while {name} spoke of {thing}.",
    "dream_content": "{name} dreamed that {npc} {verb} {thing} under {place}.",
    "aletheia_progression": "{name} began to doubt the wardens about {place} after {thing} went missing.",
}
CLASS_WEIGHTS = {"cornerstone": 0.05, "birthright": 0.05, "working": 0.75, "volatile": 0.15}


def draw_entry(rng: np.random.Generator, i: int, player_name: str, player_id: str | None = None) -> dict:
    """One plausible entry; every fifth names the player's id too (a planted identifier)."""
    category = DATA_CATEGORIES[int(rng.integers(len(DATA_CATEGORIES)))]
    klass = rng.choice(list(CLASS_WEIGHTS), p=list(CLASS_WEIGHTS.values()))
    text = TEMPLATES[category].format(
        npc=NPCS[int(rng.integers(len(NPCS)))].split(":")[1],
        name=player_name,
        verb=VERBS[int(rng.integers(len(VERBS)))],
        thing=THINGS[int(rng.integers(len(THINGS)))],
        place=PLACES[int(rng.integers(len(PLACES)))],
    )
    if player_id and i % 5 == 0:
        text += f" The ledger lists {player_id}."
    axes = rng.choice(TRAIT_AXES, size=int(rng.integers(0, 3)), replace=False)
    return {
        "text": f"{text} ({i})",
        "speaker": player_name if rng.random() < 0.3 else NPCS[i % len(NPCS)],
        "memory_class": str(klass),
        "data_category": category,
        "semantic_type": SEMANTIC_TYPES[int(rng.integers(len(SEMANTIC_TYPES)))],
        "trait_engagement": {str(a): round(float(rng.uniform(-1, 1)), 2) for a in axes},
        "emotional_valence": round(float(rng.uniform(-1, 1)), 2),
        "importance": round(float(rng.uniform(0, 1)), 2),
        "session_id": f"session-{i // 50}" if klass == "volatile" else None,
    }


def heldout_examples(n: int, seed: int | np.random.SeedSequence = 10_000) -> list[dict[str, str]]:
    """Examples shaped like the consent filter's output ([player] in place of the player), drawn
    from the same generator but from no store: the server's public held-out set."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        entry = draw_entry(rng, i, PLAYER)
        if entry["data_category"] != "clasp":
            out.append(
                {k: entry[k] for k in ("text", "speaker", "data_category", "semantic_type", "memory_class")}
            )
    return out


def generate_player(
    folder: Path,
    embedder: Embedder,
    seed: int = 0,
    entries: int = 200,
    player_name: str = "Marta",
    start: float | None = None,
    player_id: str | None = None,
    tier: str | None = None,
    append: bool = False,
) -> dict[str, Any]:
    """Fill a player's stores; returns counts. Same seed, same player (times come from ``start``).
    ``player_id`` is planted in some entries and kept in the device's profile; ``tier`` is the
    consent tier (default opt_out, as the design's). A folder that already holds a player is
    refused unless ``append``, which adds entries and keeps its consent unless ``tier`` is given
    (even then the player's exclusions and any revocation stand), and keeps its profile: the new
    entries are the profile's player's (``player_id`` and ``player_name`` give way to it)."""
    if (folder / PRIMARY_FILE).exists() and not append:
        raise NimmerError(
            f"{folder} already holds a player's stores; pass --append to add entries to them, "
            "or choose a new folder"
        )
    existing = (folder / PRIMARY_FILE).exists()
    if existing and (folder / PROFILE_FILE).exists():  # the player on this device stays who it is:
        player_id, player_name = read_profile(folder)  # its profile redacts what it shares
    rng = np.random.default_rng(seed)
    now = [start if start is not None else 1_800_000_000.0]
    memory = PlayerMemory(folder, embedder, clock=lambda: now[0])
    written = _write_entries(memory, rng, entries, player_name, player_id, now)
    tier = _draw_consent(memory, rng, tier, existing, now[0])
    if player_id and not (folder / PROFILE_FILE).exists():
        write_profile(folder, player_id, player_name)
    _plant_world(memory, seed)
    sessions = _companion_sessions(folder, rng, now[0])
    memory.close()
    return {
        "player": folder.name,
        **written,
        "consent": str(tier),
        "companion_sessions": sessions,
        "generated_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _write_entries(
    memory: PlayerMemory,
    rng: np.random.Generator,
    entries: int,
    player_name: str,
    player_id: str | None,
    now: list[float],
) -> dict[str, int]:
    """Draw ``entries`` entries, each a few minutes to an hour after the last (``now[0]`` moves):
    clasp ones written in between, the rest in one batch to the primary store; counts by store."""
    written = {"primary": 0, "clasp": 0}
    batch: list[dict] = []
    for i in range(entries):
        item = draw_entry(rng, i, player_name, player_id)
        if item["data_category"] == "clasp":
            memory.write_many([item], mode=Mode.IN_BETWEEN)
            written["clasp"] += 1
        else:
            batch.append(item)
        now[0] += float(rng.uniform(60, 3600))
    memory.write_many(batch)
    written["primary"] = len(batch)
    return written


def _draw_consent(
    memory: PlayerMemory, rng: np.random.Generator, tier: str | None, existing: bool, now: float
) -> str | None:
    """Draw shared and excluded categories and record the consent; the tier in force. A player
    already here keeps its consent when no ``tier`` is given, and its exclusions and revocation
    when one is. The record is one ``consent set`` could make: never a never-shared category
    (clasp) or an excluded one among the shared, and dated no later than now (the entries'
    clock may run ahead of the wall clock: ``start`` defaults to 2027)."""
    categories = list(DATA_CATEGORIES)
    rng.random()  # once a drawn tier; kept so that a seed's later draws stay the same
    drawn = tuple(str(c) for c in rng.choice(categories, size=int(rng.integers(1, 5)), replace=False))
    excluded = tuple(str(c) for c in rng.choice(categories, size=int(rng.integers(0, 2)), replace=False))
    shared = tuple(c for c in drawn if c not in NEVER_SHARED and c not in excluded)
    now = min(now, time.time())
    if existing and tier is None:
        return get_consent(memory).sharing_tier
    if existing:  # a new tier, but the player's exclusions and revocation stand
        old = get_consent(memory)
        excluded = tuple(dict.fromkeys([*old.excluded_categories, *excluded]))
        shared = tuple(c for c in shared if c not in excluded)
        set_consent(memory, ConsentRecord(tier or "opt_out", shared, excluded, now, old.revoked_at))
        return tier
    tier = tier or "opt_out"
    set_consent(memory, ConsentRecord(tier, shared, excluded, granted_at=now))
    return tier


def _plant_world(memory: PlayerMemory, seed: int) -> None:
    """The districts and three proclamations every generated player's store holds."""
    set_districts(memory, [("core", "ring"), ("ring", "wall"), ("wall", "frontier")])
    add_canon(
        memory,
        [
            Canon(
                f"canon-{seed}-{j}",
                f"Proclamation {j}: the curfew moves to the {j}th bell.",
                "world",
                "core",
                "normal",
                rate_ticks_per_hop=2,
                created_tick=j,
            )
            for j in range(3)
        ],
    )


def _companion_sessions(folder: Path, rng: np.random.Generator, now: float) -> int:
    """Record zero to three companion trade sessions; how many."""
    companion = open_companion(folder)
    sessions = int(rng.integers(0, 4))
    for j in range(sessions):
        record_session(
            companion,
            NPCS[j % len(NPCS)],
            GOODS_TYPES[j % 2],
            f"session {j} with {NPCS[j % 5]}",
            started_at=now + j,
        )
    companion.close()
    return sessions
