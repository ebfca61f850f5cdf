"""An agent's hormones: dopamine, cortisol and oxytocin, decaying toward a resting level on an
injected clock, spiked by events, persisted per agent, and what they mean for memory and voice.

Stable API (the dream engine and the runtime build on it)::

    h = Hormones(folder, clock)          # folder/hormones.sqlite; clock() -> now (game seconds)
    h.levels(now) -> {"dopamine": d, "cortisol": c, "oxytocin": o}   # each in [0, 1]
    h.spike(event, now, intensity=1.0)  # event in EVENTS; returns the levels after it
    h.state(now) -> hormonalState       # for memory_status (keys below)
    h.detect(text) -> [event, ...]      # events a turn's text implies (keyword rules)
    h.react(text, events, now) -> fired # spike for game events + detected ones (the runtime's call)
    h.prompt_hints(now) -> [hint, ...]  # guidance hints that differ from rest (for the prompt)
    h.modulation(now) -> Modulation     # memory processing (search, consolidation)
    h.affect_shift(now) -> (dvalence, darousal)  # the voice: departure from rest
    h.close()

Decay is exact and toward the resting level, not zero: ``v(t) = rest + (v0 - rest) * 0.5 **
(dt / half_life)`` with half-lives 30 min (dopamine), 60 (cortisol), 45 (oxytocin) and rests
0.15 / 0.02 / 0.20 (Bitterbot's homeostasis). One half-life moves exactly halfway to rest, and
decaying over a then over b equals decaying over a + b (the stored value is re-based at each
spike only; reads never write, so reading often changes nothing; a ``now`` earlier than the
last spike, e.g. another process's clock, reads the stored level). A spike adds the event's
amounts (:data:`SPIKES`, times ``intensity`` in [0, 1]) to the decayed level and caps at 1.

``state(now)`` (memory_status' ``hormonalState``): ``dopamine``, ``cortisol``, ``oxytocin``,
``mood`` (one word), ``trajectory`` ("rising": a spike in the last 10 minutes; "falling": above
rest and settling; "steady": within 0.01 of rest), ``emotionalBriefing`` (natural language,
for the agent's own status only), ``responseGuidance`` (tone hints, e.g. "be warm and personal"), ``tone``
(warmth, energy, focus, playfulness, verbosity, curiosityExpression, assertiveness,
empathyExpression, each in [0, 1]). At rest: warmth 0.30, energy 0.225, focus 0.03,
playfulness 0.139, guidance "keep it brief and to the point", briefing "Subtle emotional
undertones: faint satisfaction, gentle warmth." (golden values).

Memory processing (:class:`Modulation`) *composes* with a crystal's emotional valence instead of
replacing it (Bitterbot passes its hormonal decay resistance in place of the valence resistance,
so valence counts for little): the Ebbinghaus rate is ``lambda * (1 - r*|valence|) * (1 -
decay_resistance)``, both factors kept; ``decay_resistance = min(0.5, 0.3C + 0.2D + 0.2O) -
its value at rest``, so an agent at rest forgets exactly as the part-1 curve says. The merge
threshold rises with cortisol, ``base + 0.03 * (C - 0.02)``. Search multiplies its importance weight by
``1 + 0.2 * D`` and its recency weight by ``1 + 0.3 * C``, again relative to rest (both factors are
1 at rest), and keeps valence where it was (lifecycle only, not ranking).

The voice: :meth:`Hormones.affect_shift` is the tone's departure from rest as (valence,
arousal) offsets that the runtime adds to a turn's affect (clamped to the DSL's ranges), so an
agent at rest speaks exactly as without hormones, and the sampling knobs stay inside the
register's affect band (temperature x [0.8, 1.2] of its trait-shifted baseline, see
voice/sampling.shape_knobs). :meth:`Hormones.prompt_hints` gives the guidance hints that differ from
rest (tone words only, never the emotion's name) for the prompt's memory scope.

Persistence: ``hormones.sqlite`` in the agent folder, schema-versioned (PRAGMA user_version, as
the other stores); one row per hormone (value and the time it was set) and a spike log.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import connect, migrate

HORMONES = ("dopamine", "cortisol", "oxytocin")
HALF_LIFE_S = {"dopamine": 30 * 60.0, "cortisol": 60 * 60.0, "oxytocin": 45 * 60.0}
REST = {"dopamine": 0.15, "cortisol": 0.02, "oxytocin": 0.20}
CAP = 1.0
SPIKES: dict[str, dict[str, float]] = {
    "reward": {"dopamine": 0.3},
    "achievement": {"dopamine": 0.4, "oxytocin": 0.2},
    "error": {"cortisol": 0.3},
    "urgency": {"cortisol": 0.4},
    "social": {"oxytocin": 0.3},
    "curiosity_progress": {"dopamine": 0.2},
}
EVENTS = tuple(SPIKES)
# keyword rules for a turn's text (player or game narration); whole words, case-insensitive
PATTERNS: dict[str, re.Pattern[str]] = {
    "reward": re.compile(
        r"\b(thank(s| you)|reward(ed)?|well done|good (job|work)|here'?s your (pay|coin)|paid|bounty|"
        r"gift(ed)?|bless(ed|ing)?)\b",
        re.I,
    ),
    "achievement": re.compile(
        r"\b(we (did|made) it|success(ful)?|victory|won|triumph|quest (complete|done)|finished it|"
        r"accomplish(ed)?)\b",
        re.I,
    ),
    "error": re.compile(
        r"\b(wrong|broken|failed|failure|mistake|error|ruined|lost it|curse[sd]?|damn(ed)?)\b", re.I
    ),
    "urgency": re.compile(
        r"\b(hurry|quick(ly)?|right now|danger(ous)?|help me|urgent(ly)?|at once|they'?re coming|"
        r"attack(ed|ing|s)?)\b",
        re.I,
    ),
    "social": re.compile(
        r"\b(friend|my dear|trust you|miss(ed)? you|together|love|companion|brother|sister)\b", re.I
    ),
    "curiosity_progress": re.compile(
        r"\b(i (found|learned|discovered)|figured (it )?out|now i (know|understand)|clue)\b", re.I
    ),
}


def events_valence(events: list[str] | tuple[str, ...]) -> float:
    """The emotional valence a memory of these events carries, read from their spikes (dopamine
    and oxytocin pleasant, cortisol unpleasant), summed and clamped to [-1, 1]."""
    total = sum(
        SPIKES[e].get("dopamine", 0.0) + SPIKES[e].get("oxytocin", 0.0) - SPIKES[e].get("cortisol", 0.0)
        for e in events
    )
    return max(-1.0, min(1.0, total))


META_VERSION = 1
HORMONE_SCHEMA_V1 = """
CREATE TABLE hormone_levels (
    name TEXT PRIMARY KEY CHECK (name IN ('dopamine', 'cortisol', 'oxytocin')),
    value REAL NOT NULL CHECK (value BETWEEN 0 AND 1),
    at REAL NOT NULL
);
CREATE TABLE hormone_events (
    id INTEGER PRIMARY KEY,
    at REAL NOT NULL,
    event TEXT NOT NULL,
    intensity REAL NOT NULL,
    dopamine REAL NOT NULL,
    cortisol REAL NOT NULL,
    oxytocin REAL NOT NULL
);
"""
HORMONE_MIGRATIONS = (HORMONE_SCHEMA_V1,)
STORE = "hormones.sqlite"
RISING_S = 600.0  # a spike within this many seconds: the trajectory is "rising"


def decay(value: float, rest: float, half_life_s: float, dt_s: float) -> float:
    """``value`` after ``dt_s`` seconds of exact exponential decay toward ``rest``."""
    return rest + (value - rest) * 0.5 ** (max(0.0, dt_s) / half_life_s)


def tone(levels: dict[str, float]) -> dict[str, float]:
    """The response modulation of these levels (Bitterbot's linear forms), each in [0, 1]."""
    d, c, o = levels["dopamine"], levels["cortisol"], levels["oxytocin"]
    return {
        "warmth": min(1.0, 1.5 * o),
        "energy": min(1.0, 1.5 * d),
        "focus": min(1.0, 1.5 * c),
        "playfulness": (0.4 * d + 0.4 * o) * (1 - 0.5 * c),
        "verbosity": min(1.0, max(0.0, 0.4 * d + 0.4 * o - 0.3 * c)),
        "curiosityExpression": min(1.0, 0.3 + 0.5 * d - 0.3 * c),
        "assertiveness": min(1.0, 0.3 + 0.5 * c + 0.2 * d),
        "empathyExpression": min(1.0, 0.2 + 0.8 * o),
    }


# (tone key, comparison, threshold, hint); thresholds sit off the values the spikes reach exactly
GUIDANCE = (
    ("energy", ">", 0.4, "be enthusiastic and celebrate wins"),
    ("warmth", ">", 0.4, "be warm and personal"),
    ("focus", ">", 0.4, "be concise and action-oriented"),
    ("playfulness", ">", 0.3, "allow some playfulness"),
    ("verbosity", "<", 0.3, "keep it brief and to the point"),
)


def guidance(t: dict[str, float]) -> list[str]:
    return [
        hint
        for key, op, edge, hint in GUIDANCE
        if (t[key] > edge + 1e-9 if op == ">" else t[key] < edge - 1e-9)
    ]


def _strength(value: float) -> str:
    """A level's briefing word: cut-offs 0.05 / 0.3 / 0.6."""
    if value < 0.05:
        return ""
    if value < 0.3:
        return "faint"
    if value < 0.6:
        return "clear"
    return "strong"


_FEELING = {"dopamine": "satisfaction", "cortisol": "tension", "oxytocin": "warmth"}
_ADJ = {"faint": "faint", "clear": "noticeable", "strong": "strong"}


def briefing(levels: dict[str, float]) -> str:
    """Natural language for the agent's own status (never put in a prompt)."""
    parts = []
    for name in HORMONES:
        word = _strength(levels[name])
        if word:
            adj = "gentle" if name == "oxytocin" and word == "faint" else _ADJ[word]
            parts.append(f"{adj} {_FEELING[name]}")
    if not parts:
        return "Emotionally even: nothing colours this moment."
    top = max(levels[n] for n in HORMONES)
    lead = "Subtle emotional undertones" if top < 0.3 else "Strong feelings" if top >= 0.6 else "Feelings"
    return f"{lead}: {', '.join(parts)}."


def mood(levels: dict[str, float]) -> str:
    """One word: the hormone furthest above its rest, or "calm" when none is 0.1 above it."""
    lift = {n: levels[n] - REST[n] for n in HORMONES}
    d, c, o = lift["dopamine"], lift["cortisol"], lift["oxytocin"]
    if max(d, c, o) < 0.1:
        return "calm"
    if c >= max(d, o):
        return "stressed" if c >= 0.3 else "tense"
    if d >= o:
        return "elated" if d >= 0.3 else "content"
    return "affectionate" if o >= 0.3 else "warm"


REST_TONE = tone(REST)
REST_GUIDANCE = guidance(REST_TONE)


@dataclass(frozen=True)
class Modulation:
    """What the hormones do to memory processing at one moment (all neutral at rest).

    ``decay_resistance``: the extra share of the Ebbinghaus rate removed, on top of (multiplied
    with) valence's own resistance; ``merge_raise``: added to the merge threshold;
    ``importance_factor`` / ``recency_factor``: multiply search's importance / recency weights.
    """

    decay_resistance: float = 0.0
    merge_raise: float = 0.0
    importance_factor: float = 1.0
    recency_factor: float = 1.0

    @classmethod
    def of(cls, levels: dict[str, float]) -> Modulation:
        d, c, o = levels["dopamine"], levels["cortisol"], levels["oxytocin"]

        def resistance(d: float, c: float, o: float) -> float:
            return min(0.5, 0.3 * c + 0.2 * d + 0.2 * o)

        rest = REST
        return cls(
            decay_resistance=max(
                0.0, resistance(d, c, o) - resistance(rest["dopamine"], rest["cortisol"], rest["oxytocin"])
            ),
            merge_raise=0.03 * (c - rest["cortisol"]),
            importance_factor=(1 + 0.2 * d) / (1 + 0.2 * rest["dopamine"]),
            recency_factor=(1 + 0.3 * c) / (1 + 0.3 * rest["cortisol"]),
        )


NEUTRAL = Modulation()


def affect_shift(t: dict[str, float]) -> tuple[float, float]:
    """(valence, arousal) offsets of a tone from the resting tone: energy and focus arouse;
    energy and warmth please, focus (cortisol) distresses. Zero at rest."""
    de = t["energy"] - REST_TONE["energy"]
    dw = t["warmth"] - REST_TONE["warmth"]
    df = t["focus"] - REST_TONE["focus"]
    return 0.5 * de + 0.5 * dw - 0.8 * df, 0.6 * de + 0.4 * df


class Hormones:
    """One agent's hormones, persisted in ``folder/hormones.sqlite``; ``clock`` gives ``now``."""

    def __init__(self, folder: Path, clock: Callable[[], float] = time.time) -> None:
        self.path = Path(folder) / STORE
        self.clock = clock
        self.db = connect(self.path)
        migrate(self.db, HORMONE_MIGRATIONS, self.path)
        rows = {r[0]: (r[1], r[2]) for r in self.db.execute("SELECT name, value, at FROM hormone_levels")}
        if len(rows) < len(HORMONES):  # a new agent starts at rest
            now = clock()
            with self.db:
                for name in HORMONES:
                    if name not in rows:
                        self.db.execute(
                            "INSERT INTO hormone_levels (name, value, at) VALUES (?, ?, ?)",
                            (name, REST[name], now),
                        )
                        rows[name] = (REST[name], now)
        self._base = {n: rows[n] for n in HORMONES}
        self._version = self.db.execute("PRAGMA data_version").fetchone()[0]

    def _refresh(self) -> None:
        """Reload the levels when another connection (another process, or another Hormones on
        this folder) committed since we last read them."""
        version = self.db.execute("PRAGMA data_version").fetchone()[0]
        if version != self._version:
            rows = {r[0]: (r[1], r[2]) for r in self.db.execute("SELECT name, value, at FROM hormone_levels")}
            self._base = {n: rows[n] for n in HORMONES}
            self._version = version

    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else float(now)

    def levels(self, now: float | None = None) -> dict[str, float]:
        """Each hormone at ``now`` (the clock's now if None); a read never writes."""
        now = self._now(now)
        self._refresh()
        out = {}
        for name in HORMONES:
            value, at = self._base[name]  # a now before ``at`` (another clock) reads the stored value
            out[name] = decay(value, REST[name], HALF_LIFE_S[name], now - at)
        return out

    def spike(self, event: str, now: float | None = None, intensity: float = 1.0) -> dict[str, float]:
        """Apply ``event`` (one of :data:`EVENTS`) at ``now``; returns the levels after it (capped)."""
        if event not in SPIKES:
            raise NimmerError(f"hormone event {event!r} is not one of {', '.join(EVENTS)}")
        if not 0.0 <= intensity <= 1.0 or math.isnan(intensity):
            raise NimmerError(f"hormone event {event}: intensity {intensity} is outside [0, 1]")
        now = self._now(now)
        levels = self.levels(now)
        for name, amount in SPIKES[event].items():
            levels[name] = min(CAP, levels[name] + amount * intensity)
        with self.db:
            for name in HORMONES:
                self.db.execute(
                    "UPDATE hormone_levels SET value = ?, at = ? WHERE name = ?", (levels[name], now, name)
                )
            self.db.execute(
                "INSERT INTO hormone_events (at, event, intensity, dopamine, cortisol, oxytocin) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (now, event, intensity, levels["dopamine"], levels["cortisol"], levels["oxytocin"]),
            )
        self._base = {n: (levels[n], now) for n in HORMONES}
        return levels

    @staticmethod
    def detect(text: str) -> list[str]:
        """The events a turn's text implies, in :data:`EVENTS` order (each at most once)."""
        return [event for event in EVENTS if PATTERNS[event].search(text or "")]

    def react(
        self, text: str = "", events: tuple[str, ...] | list[str] = (), now: float | None = None
    ) -> list[str]:
        """Spike for each game event, then for each event ``text`` implies that the game did not
        already report (the same moment told twice counts once); returns what fired, in order."""
        fired = [*events, *(e for e in self.detect(text) if e not in events)]
        now = self._now(now)
        for event in fired:
            self.spike(event, now)
        return fired

    def state(self, now: float | None = None) -> dict[str, object]:
        """The hormonalState of memory_status (see the module docstring)."""
        levels = self.levels(now)
        t = tone(levels)
        at = self._now(now)
        lifted = max(levels[n] - REST[n] for n in HORMONES)
        recent = self.db.execute(
            "SELECT count(*) FROM hormone_events WHERE at BETWEEN ? AND ? AND intensity > 0",
            (at - RISING_S, at),
        ).fetchone()[0]
        trajectory = "rising" if recent else "falling" if lifted >= 0.01 else "steady"
        return {
            **{n: round(levels[n], 6) for n in HORMONES},
            "mood": mood(levels),
            "trajectory": trajectory,
            "emotionalBriefing": briefing(levels),
            "responseGuidance": guidance(t),
            "tone": {k: round(v, 6) for k, v in t.items()},
        }

    def modulation(self, now: float | None = None) -> Modulation:
        return Modulation.of(self.levels(now))

    def affect_shift(self, now: float | None = None) -> tuple[float, float]:
        return affect_shift(tone(self.levels(now)))

    def prompt_hints(self, now: float | None = None) -> list[str]:
        """Guidance hints that differ from the resting guidance (none at rest): tone only."""
        return [h for h in guidance(tone(self.levels(now))) if h not in REST_GUIDANCE]

    def close(self) -> None:
        self.db.close()
