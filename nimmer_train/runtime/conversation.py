"""A conversation per (player, NPC): its lines kept durably, the window of its last turns that fits
a prompt, the memory query its recent turns make, and the valence a turn gives its memories.

Where the lines live (design, "The clasp store and the in-between dimension"):

- **Realworld** lines: ``conversation.sqlite`` in the player's folder (:class:`Conversations`),
  one row per line, and each line also as a memory entry in primary (the player's own words,
  speaker ``player``; the NPC's, ``npc:<name>``). The row is the write's outbox: it is committed
  before the memory write and marked written after it, so a write that fails (or a process killed
  in between) is retried at the next turn by whichever runtime opens the folder, under the same
  event_uid (a retry never writes a line twice).
- **In-between** lines never touch that file: they are memory entries of the clasp store only
  (session ``conversation:<npc>``), read back for the window only when the prompt stays on the
  device (Ring A), and a failed clasp write waits in the speaking process (the clasp has no other
  durable place that is sealed).

Two processes speaking for one NPC: every append is one ``BEGIN IMMEDIATE`` transaction that
numbers its turn inside it (WAL, a 5 s busy timeout), so both processes' turns are kept, whole
and numbered in commit order; each sees the other's lines in its next window. Their memory writes
carry distinct event_uids; a pending line two processes retry at once is stored once (the loser
finds it stored and marks it written). Neither corrupts the file; the clasp store admits one
opener (the second gets ``ClaspBusy``, and its in-between writes wait).

The window: the newest whole turns whose lines, as the ring renders and counts them, fit the
token budget the turn leaves (runtime/turn.py: the ring's context less the bare prompt, the
knowledge stack's budgets and the reply); older turns leave the prompt but not memory, where the
knowledge stack finds them by relevance (the window's own lines are excluded there, so nothing is
shown twice).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.agent.hormones import SPIKES, Hormones
from nimmer_train.errors import ConfigError
from nimmer_train.memory.db import connect, migrate
from nimmer_train.memory.entries import MemoryEntry
from nimmer_train.voice.prompt_dsl import NPC, PLAYER, conversation_tokens

CONVERSATION_FILE = "conversation.sqlite"
CONVERSATION_SCHEMA_V1 = """
CREATE TABLE lines (
    id INTEGER PRIMARY KEY,
    npc TEXT NOT NULL,
    turn INTEGER NOT NULL,
    speaker TEXT NOT NULL CHECK (speaker IN ('player', 'npc')),
    text TEXT NOT NULL,
    at REAL NOT NULL,
    uid TEXT NOT NULL UNIQUE,           -- the event_uid of the line's memory entry in primary
    fields TEXT NOT NULL DEFAULT '{}',  -- the entry's other fields (valence, trait profile, ...)
    written INTEGER NOT NULL DEFAULT 0  -- 0: pending, 1: in primary, -1: refused by the store
);
CREATE INDEX lines_npc ON lines (npc, turn);
CREATE INDEX lines_pending ON lines (written) WHERE written = 0;
"""
CONVERSATION_MIGRATIONS = (CONVERSATION_SCHEMA_V1,)
RECENT_LINES = 200  # lines read for a window (a budget rarely holds more)
_SURROGATE = re.compile("[\ud800-\udfff]")


def session_of(npc: str) -> str:
    """The memory entries' session of the conversation with ``npc`` (both stores)."""
    return f"conversation:{npc}"


@dataclass(frozen=True)
class Line:
    """One line of a conversation; ``turn_key`` groups a player line with the NPC's answer."""

    speaker: str  # PLAYER or NPC
    text: str
    at: float
    uid: str  # its memory entry's event_uid
    turn_key: str
    fields: dict[str, Any] = field(default_factory=dict)


def line_uid(turn_key: str, speaker: str) -> str:
    return f"{turn_key}-{speaker}"


def from_entry(entry: MemoryEntry) -> Line:
    """A conversation line read back from its memory entry (the in-between's lines)."""
    speaker = PLAYER if entry.speaker == PLAYER else NPC
    return Line(speaker, entry.text, entry.created_at, entry.event_uid, entry.event_uid.rsplit("-", 1)[0])


class Conversations:
    """The realworld conversations of one player folder (``conversation.sqlite``)."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / CONVERSATION_FILE
        self.db = connect(self.path)
        self.db.execute("BEGIN IMMEDIATE")  # two processes creating the store at once: one migrates
        try:
            migrate(self.db, CONVERSATION_MIGRATIONS, self.path)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise

    def append(self, npc: str, lines: list[tuple[str, str]], at: float, fields: dict[str, Any]) -> list[Line]:
        """One turn's lines (speaker, text), numbered after the NPC's last turn in the same
        transaction (another process appending waits for it); pending until :meth:`mark`."""
        out = []
        self.db.execute("BEGIN IMMEDIATE")
        try:
            row = self.db.execute("SELECT MAX(turn) FROM lines WHERE npc = ?", (npc,)).fetchone()
            turn = (row[0] or 0) + 1
            key = f"conv-{npc}-t{turn}"
            for speaker, text in lines:
                line = Line(speaker, text, at, line_uid(key, speaker), key, dict(fields))
                self.db.execute(
                    "INSERT INTO lines (npc, turn, speaker, text, at, uid, fields) "
                    "VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (npc, turn, speaker, text, at, line.uid, json.dumps(fields, sort_keys=True)),
                )
                out.append(line)
            self.db.execute("COMMIT")
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        return out

    def recent(self, npc: str, limit: int = RECENT_LINES) -> list[Line]:
        """The NPC's newest ``limit`` lines, newest first."""
        rows = self.db.execute(
            "SELECT speaker, text, at, uid, npc, turn, fields FROM lines WHERE npc = ? "
            "ORDER BY turn DESC, id DESC LIMIT ?",
            (npc, limit),
        )
        return [_line(row) for row in rows]

    def pending(self, limit: int = 64) -> list[tuple[str, Line]]:
        """Lines not yet in memory (this process's failed writes or a killed one's), oldest
        first, as (npc, line)."""
        rows = self.db.execute(
            "SELECT speaker, text, at, uid, npc, turn, fields FROM lines WHERE written = 0 "
            "ORDER BY id LIMIT ?",
            (limit,),
        )
        return [(row[4], _line(row)) for row in rows]

    def mark(self, uids: list[str], written: int = 1) -> None:
        with self.db:
            self.db.executemany("UPDATE lines SET written = ? WHERE uid = ?", [(written, u) for u in uids])

    def count(self, npc: str) -> int:
        return self.db.execute("SELECT COUNT(*) FROM lines WHERE npc = ?", (npc,)).fetchone()[0]

    def close(self) -> None:
        self.db.close()


def _line(row: tuple) -> Line:
    speaker, text, at, uid, npc, turn, fields = row
    return Line(speaker, text, at, uid, f"conv-{npc}-t{turn}", json.loads(fields))


def storable(text: str) -> str:
    """``text`` as UTF-8 can store it: a lone surrogate (a broken client's half of a pair)
    becomes U+FFFD, the rest of the line is kept."""
    return _SURROGATE.sub("\ufffd", text)


def clasp_turn_key(npc: str) -> str:
    """An in-between turn's key: random, so nothing counts in-between turns from outside the clasp."""
    return f"conv-{npc}-clasp-{uuid.uuid4().hex[:12]}"


def window(newest_first: list[Line], budget: int, count: Callable[[str], int]) -> list[Line]:
    """The newest whole turns whose lines cost at most ``budget`` tokens by ``count`` (as the
    prompt renders them), oldest first. A turn that does not fit ends the window (it stays
    contiguous), and a turn is never cut: a player line without its answer would read as the
    question being asked now."""
    turns: list[list[Line]] = []
    for line in newest_first:
        if turns and turns[-1][0].turn_key == line.turn_key:
            turns[-1].append(line)
        else:
            turns.append([line])
    kept: list[Line] = []
    used = 0
    for turn in turns:
        cost = sum(conversation_tokens(line.speaker, line.text, count) for line in turn)
        if used + cost > budget:
            break
        used += cost
        kept.extend(turn)
    return kept[::-1]


def check_window(
    tokens: int, reply: int, rings: dict[str, Any], key: str = "runtime.conversation_tokens"
) -> None:
    """Refuse a window budget that, with the reply, fills a ring's context: the turn would clamp it
    silently at every turn (the window takes only what the context leaves), so a budget that can
    never be had is a configuration mistake, said once before anything is spoken."""
    for tier, ring in rings.items():
        context = getattr(ring, "context_tokens", None)
        if context and tokens + reply >= context:
            raise ConfigError(
                key,
                f"{tokens} conversation tokens and {reply} reply tokens (runtime.max_new_tokens) do not "
                f"fit ring {ring.name}'s context of {context} tokens (tier {tier}): set it below "
                f"{context - reply}, less the prompt's own tokens",
            )


def query_vector(
    embedder: Any, utterance: str, recent: list[Line], k: int = 4, decay: float = 0.5
) -> np.ndarray:
    """The memory query of a turn: the player's line (weight 1) and the player's last ``k``
    lines before it (weights ``decay``, ``decay**2``, ... newest first), embedded in one batch,
    each unit vector weighted and summed, then normalised. The last line leads; the lines before
    it bring the topic ("what was her name?" asks about the sister named a line earlier). The
    NPC's lines stay out: in benchmarks/bench_conversation_recall.py they pulled the query toward
    the NPC's own recent words (prompt recall 0.2 with them at k=4, against 1.0 without)."""
    mine = [line.text for line in recent if line.speaker == PLAYER]
    texts = [utterance, *mine[:k]]
    vectors = np.asarray(embedder.embed(texts), dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = vectors / np.where(norms == 0, 1.0, norms)
    weights = np.array([decay**i for i in range(len(texts))], dtype=np.float32)
    q = (vectors * weights[:, None]).sum(axis=0)
    n = float(np.linalg.norm(q))
    return q / n if n else q


def event_valence(event: str) -> float:
    """An event's valence, read from its hormone spike: dopamine and oxytocin pleasant, cortisol
    unpleasant (agent/hormones.py SPIKES is the one table of events)."""
    spike = SPIKES[event]
    return spike.get("dopamine", 0.0) + spike.get("oxytocin", 0.0) - spike.get("cortisol", 0.0)


def turn_events(utterance: str, game_events: tuple[str, ...]) -> list[str]:
    """The turn's events: the game's, then those the player's words imply (each once)."""
    return [*game_events, *(e for e in Hormones.detect(utterance) if e not in game_events)]


def turn_valence(affect_valence: float, events: list[str]) -> float:
    """A turn memory's emotional valence: the turn's affect plus its events' valences, in [-1, 1]."""
    return max(-1.0, min(1.0, affect_valence + sum(event_valence(e) for e in events)))
