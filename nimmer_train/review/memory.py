"""A player's stores and an agent's crystals, read only through their export paths (notebook 05).

What this module may read is what leaves a store anyway: a player's primary entries
(``PlayerMemory.entries``, which never opens the clasp store), the consent record and what the
consent filter would share (``consent.training_examples``, redacted), the fallback snapshot's
time, and an agent's crystals and status in real-world mode (``AgentMemory.crystals`` on the
primary store, ``memory_status(Mode.REALWORLD)``). Nothing here opens the clasp store: no
function takes a mode, and the in-between mode is the only reader of clasp.
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from nimmer_train.agent.importance import importance, never_decays
from nimmer_train.errors import NimmerError
from nimmer_train.memory.consent import (
    TRAINING_TIERS,
    consent_view,
    get_consent,
    read_profile,
    training_examples,
)
from nimmer_train.memory.embedding import NoEmbedder
from nimmer_train.memory.player_memory import PRIMARY_FILE, Mode, PlayerMemory
from nimmer_train.memory.sync import FALLBACK_FILE

DAY_S = 86_400.0
NOT_BUILT = "not built yet"


def _player(folder: Path) -> PlayerMemory:
    if not (folder / PRIMARY_FILE).exists():
        raise NimmerError(
            f"no player at {folder} (no {PRIMARY_FILE}); `nimmer memory generate {folder}` makes one"
        )
    return PlayerMemory(folder, NoEmbedder())


def find_player(workdir: Path) -> Path | None:
    """The demo's player (``players/*``), else a simulated federation device; None when neither."""
    for pattern in ("players/*", "federation/*/devices/device-*"):
        found = sorted(p for p in workdir.glob(pattern) if (p / PRIMARY_FILE).exists())
        if found:
            return found[0]
    return None


def player_entries(folder: Path) -> pd.DataFrame:
    """The primary store's entries (never the clasp store): class, category, type, importance, text."""
    memory = _player(folder)
    try:
        rows = [
            {
                "created_at": pd.Timestamp(e.created_at, unit="s"),
                "memory_class": e.memory_class,
                "data_category": e.data_category,
                "semantic_type": e.semantic_type,
                "importance": e.importance,
                "valence": e.emotional_valence,
                "access_count": e.access_count,
                "last_access": e.last_access or e.created_at,
                "text": e.text,
            }
            for e in memory.entries()
        ]
    finally:
        memory.close()
    return pd.DataFrame(rows)


def player_summary(folder: Path) -> dict[str, Any]:
    """Counts by class and category, the snapshot, the consent record and how many entries the
    consent filter would share (redacted) per training tier."""
    memory = _player(folder)
    try:
        entries = memory.entries()
        record = get_consent(memory)
        try:
            player_id, name = read_profile(folder)
            shared = {t: len(training_examples(memory, t, player_id, name)) for t in TRAINING_TIERS}
        except NimmerError:
            shared = dict.fromkeys(TRAINING_TIERS, 0)  # no profile: nothing can be shared
    finally:
        memory.close()
    return {
        "player": folder.name,
        "entries": len(entries),
        "by_class": dict(Counter(e.memory_class for e in entries)),
        "by_category": dict(Counter(e.data_category for e in entries)),
        "fallback_snapshot": (folder / FALLBACK_FILE).exists(),
        "consent_tier": record.sharing_tier,
        "categories_shared": consent_view(record)["categories_shared"],  # as the consent filter enforces it
        "excluded": list(record.excluded_categories),
        "shareable_examples": shared,
        "clasp": "never read here: no export path exists for it",
    }


def importance_curves(entries: pd.DataFrame, days: int = 60) -> pd.DataFrame:
    """Mean Ebbinghaus importance per semantic type over the next ``days`` days if nothing is read
    (cornerstone and birthright entries never decay)."""
    grid = np.arange(days + 1)
    curves = {}
    for kind, group in entries.groupby("semantic_type"):
        values = [
            [
                importance(
                    kind,
                    int(r.access_count),
                    d * DAY_S,
                    float(r.valence),
                    base=float(r.importance),
                    decays=not never_decays("", "decay", r.memory_class),
                )
                for d in grid
            ]
            for r in group.itertuples()
        ]
        curves[kind] = np.mean(values, axis=0)
    return pd.DataFrame(curves, index=pd.Index(grid, name="days from now"))


def agent_crystals(folder: Path) -> pd.DataFrame | None:
    """An agent's crystals in the primary store (real-world mode), one row each; None when the
    folder holds no agent."""
    if not (folder / PRIMARY_FILE).exists():
        return None
    from nimmer_train.agent.agent_memory import AgentMemory

    agent = AgentMemory(folder, NoEmbedder())
    try:
        crystals = agent.crystals("primary")
    finally:
        agent.close()
    columns = [
        "id",
        "lifecycle",
        "semantic_type",
        "origin",
        "importance",
        "created_at",
        "merged_from",
        "text",
    ]
    rows = [{"entry_id": c.entry_id, **{k: c.public()[k] for k in columns}} for c in crystals]
    frame = pd.DataFrame(rows, columns=["entry_id", *columns]).set_index("entry_id")
    frame["created_at"] = pd.to_datetime(frame["created_at"], unit="s")
    return frame


def agent_status(folder: Path) -> dict[str, Any] | None:
    """``memory_status`` in real-world mode (the primary store only)."""
    if not (folder / PRIMARY_FILE).exists():
        return None
    from nimmer_train.agent.agent_memory import AgentMemory

    agent = AgentMemory(folder, NoEmbedder())
    try:
        return agent.memory_status(Mode.REALWORLD)
    finally:
        agent.close()


def dream_insights(crystals: pd.DataFrame) -> pd.DataFrame:
    """Crystals the dream engine made, with the texts of the crystals they came from."""
    dreams = crystals[crystals["origin"] == "dream"]
    texts = dict(zip(crystals.index, crystals["text"], strict=True))
    return dreams.assign(sources=dreams["merged_from"].map(lambda ids: [texts.get(i, i) for i in ids]))


def built(module: str) -> bool:
    """Whether ``nimmer_train.memory.<module>`` exists yet (hormones, dreams: other issues)."""
    return importlib.util.find_spec(f"nimmer_train.memory.{module}") is not None


DAY_EVENTS = ((9.0, "reward"), (13.0, "error"), (13.25, "urgency"), (18.0, "social"))


def hormone_day(
    agent_dir: Path | None, events: tuple[tuple[float, str], ...] = DAY_EVENTS, step_minutes: int = 10
) -> pd.DataFrame:
    """An agent's hormones over a simulated day of game events (hour, event), starting from its
    stored levels (or from rest without an agent), on a copy of its hormone store: the agent's
    own store is never written. One row per step: the three levels and the mood word."""
    import sqlite3
    import tempfile

    from nimmer_train.agent.hormones import HORMONES, STORE, Hormones, mood

    with tempfile.TemporaryDirectory() as tmp:
        stored = None if agent_dir is None else agent_dir / STORE
        if stored is not None and stored.is_file():  # a consistent read-only copy, WAL included
            source = sqlite3.connect(f"{stored.resolve().as_uri()}?mode=ro", uri=True)
            target = sqlite3.connect(Path(tmp) / STORE)
            try:
                source.backup(target)
            finally:
                source.close()
                target.close()
        start = time.time()
        clock = {"now": start}
        hormones = Hormones(Path(tmp), lambda: clock["now"])
        rows, pending = [], sorted(events)
        try:
            for step in range(24 * 60 // step_minutes + 1):
                hour = step * step_minutes / 60
                clock["now"] = start + hour * 3600
                while pending and pending[0][0] <= hour:
                    hormones.spike(pending.pop(0)[1], clock["now"])
                levels = hormones.levels(clock["now"])
                rows.append({"hour": hour, **{n: levels[n] for n in HORMONES}, "mood": mood(levels)})
        finally:
            hormones.close()
    return pd.DataFrame(rows).set_index("hour")
