"""The dream engine: gated background synthesis of insight crystals in six modes.

Gate (:func:`evaluate_gate`, a pure function of :class:`GateState` and ``now``): a full cycle only
with at least ``min_new_sessions`` new sessions since the last cycle, ``min_idle_s`` (60 min) of
idleness and ``min_between_s`` (8 h) since the last cycle, so an idle day runs none. Mini-dreams
fire on a *rise* of a hormone by at least ``delta`` since the previous check (a hormone pinned
high fires once): a dopamine rise replays, any other compresses; neither asks an LLM.
The state (counters, last levels, the LLM call log) lives in ``memory_meta`` (``dream_state``), so
a restart keeps it.

Modes:

- replay: the top seeds by importance * (1 + |valence|) gain 0.1 * (1 - 0.6^k) / 0.4 importance,
  k ~ Poisson(3) clamped to [1, 7]; no insight;
- compression: greedy clusters (cosine >= ``compress_threshold``, >= 3 members) become one insight
  citing its sources; confidence min(0.8, 0.2 + 0.1 min(n, 4) + 0.05 min(shared words, 6)); at
  >= ``archive_confidence`` the sources are archived, otherwise consolidated;
- mutation, extrapolation, simulation, exploration: one teacher call each (issue 3's backends)
  within per-cycle and per-hour budgets; a returned insight is kept only if its cosine to some
  source is at least ``relevance`` (the relevance gate).

Mode selection (:func:`select_modes`): exploration is forced while curiosity targets are open,
mutation while skill crystals exist; the rest are drawn without replacement with probabilities
proportional to ``weight ** (1 / T)`` (a softmax over log-weights at temperature T, so at T = 1
the frequencies equal the weights), T = clamp(1 + D - 0.6 C + 0.3 O, 0.3, 2) from the hormone
levels. Every random draw comes from a generator seeded by (seed, cycle number) and every time
from the agent's clock, so a seeded day replays identically.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from nimmer_train.agent import curiosity
from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.crystals import ACTIVE, CrystalSpec, load, transition
from nimmer_train.agent.search import GONE
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import get_meta, set_meta
from nimmer_train.voice.composition import GenerationRequest, request_key
from nimmer_train.voice.prompt_dsl import AffectState, MemoryScope, TurnPrompt
from nimmer_train.voice.sampling import SamplingKnobs

HOUR = 3600.0
MODES = ("replay", "compression", "mutation", "extrapolation", "simulation", "exploration")
LLM_MODES = ("mutation", "extrapolation", "simulation", "exploration")
BASE_WEIGHTS = {
    "replay": 0.2,
    "compression": 0.2,
    "mutation": 0.15,
    "simulation": 0.15,
    "extrapolation": 0.1,
    "exploration": 0.1,
}
_COLUMNS = "SELECT c.entry_id, e.event_uid, e.text, c.importance, e.emotional_valence, e.semantic_type"
HORMONES = ("dopamine", "cortisol", "oxytocin")
Levels = Callable[[float], Mapping[str, float]]
_WORD = re.compile(r"[a-z]{4,}")
_STOP = frozenset({"that", "this", "with", "from", "have", "were", "they", "their", "there", "about"})


@dataclass(frozen=True)
class DreamConfig:
    min_new_sessions: int = 1
    min_idle_s: float = 60 * 60.0
    min_between_s: float = 8 * HOUR
    delta: float = 0.15  # a hormone rise that fires a mini-dream
    replay_seeds: int = 5
    compress_threshold: float = 0.85
    compress_pool: int = 2000  # newest active crystals considered for compression
    compress_max: int = 8  # members per cluster
    archive_confidence: float = 0.7
    relevance: float = 0.4
    calls_per_cycle: int = 5
    calls_per_hour: int = 20
    max_modes: int = 3
    max_insights: int = 200  # live insights kept; the least important beyond it are archived
    weights: Mapping[str, float] = field(default_factory=lambda: dict(BASE_WEIGHTS))


@dataclass(frozen=True)
class GateState:
    """What the gate reads: persisted counters plus two facts gathered from the store."""

    last_cycle_at: float | None = None
    new_sessions: int = 0
    last_activity_at: float | None = None


def evaluate_gate(cfg: DreamConfig, state: GateState, now: float) -> tuple[bool, str]:
    """Whether a full cycle may run at ``now``, and why (or why not)."""
    if state.new_sessions < cfg.min_new_sessions:
        return False, f"{state.new_sessions} new sessions since the last cycle (needs {cfg.min_new_sessions})"
    if state.last_activity_at is not None and now - state.last_activity_at < cfg.min_idle_s:
        idle = (now - state.last_activity_at) / 60
        return False, f"idle {idle:.0f} min (needs {cfg.min_idle_s / 60:.0f})"
    if state.last_cycle_at is not None and now - state.last_cycle_at < cfg.min_between_s:
        since = (now - state.last_cycle_at) / HOUR
        return False, f"{since:.1f} h since the last cycle (needs {cfg.min_between_s / HOUR:.0f})"
    return True, "ready"


def rises(before: Mapping[str, float], after: Mapping[str, float], delta: float) -> list[str]:
    """Hormones that rose by at least ``delta`` since the previous check (a pinned one: none)."""
    return [h for h in HORMONES if h in after and after[h] - before.get(h, after[h]) >= delta - 1e-12]


def temperature(levels: Mapping[str, float]) -> float:
    d, c, o = (float(levels.get(h, 0.0)) for h in HORMONES)
    return float(min(2.0, max(0.3, 1.0 + d - 0.6 * c + 0.3 * o)))


def mode_weights(cfg: DreamConfig, counts: Mapping[str, int]) -> dict[str, float]:
    """The base weights with curiosity's adjustments (>= 2 gaps: exploration +0.15; a
    contradiction: simulation +0.10; >= 2 frontiers: mutation +0.10)."""
    w = {m: float(cfg.weights.get(m, 0.0)) for m in MODES}
    if counts.get("knowledge_gap", 0) >= 2:
        w["exploration"] += 0.15
    if counts.get("contradiction", 0) >= 1:
        w["simulation"] += 0.10
    if counts.get("frontier", 0) >= 2:
        w["mutation"] += 0.10
    return w


def probabilities(weights: Mapping[str, float], temp: float) -> np.ndarray:
    w = np.array([max(0.0, weights[m]) for m in MODES], dtype=np.float64)
    p = np.where(w > 0, w ** (1.0 / temp), 0.0)
    return p / p.sum()


def select_modes(
    cfg: DreamConfig,
    counts: Mapping[str, int],
    levels: Mapping[str, float],
    has_skills: bool,
    rng: np.random.Generator,
) -> list[str]:
    """1 to ``max_modes`` modes: the forced ones, then weighted draws without replacement."""
    forced = (["exploration"] if sum(counts.values()) > 0 else []) + (["mutation"] if has_skills else [])
    k = max(len(forced), int(rng.integers(1, cfg.max_modes + 1)))
    p = probabilities(mode_weights(cfg, counts), temperature(levels))
    for m in forced:
        p[MODES.index(m)] = 0.0
    draws = k - len(forced)
    if draws <= 0 or p.sum() == 0:
        return forced
    picked = rng.choice(len(MODES), size=min(draws, int((p > 0).sum())), replace=False, p=p / p.sum())
    return forced + [MODES[i] for i in picked]


class DreamEngine:
    """Dreams for one agent. ``hormones``: a callable ``now -> levels``, a fixed mapping, or None
    (the agent's ``hormones`` when it has one, else all at 0). ``teacher``: a teacher backend of
    issue 3 (``generate(batch) -> replies``) for the four LLM modes; None skips them."""

    def __init__(
        self,
        agent: CrystalStore,
        hormones: Levels | Mapping[str, float] | None = None,
        teacher: Any = None,
        config: DreamConfig | None = None,
        seed: int = 0,
    ) -> None:
        self.agent, self.teacher, self.cfg, self.seed = agent, teacher, config or DreamConfig(), seed
        if hormones is None and getattr(agent, "hormones", None) is not None:
            hormones = agent.hormones.levels  # opened now, before any ``now`` this engine takes
        self._hormones = hormones

    # -- state -----------------------------------------------------------------------------------
    def levels(self, now: float) -> dict[str, float]:
        source = self._hormones
        if source is None:
            return dict.fromkeys(HORMONES, 0.0)
        levels = source(now) if callable(source) else source
        return {h: float(levels.get(h, 0.0)) for h in HORMONES}

    def state(self) -> dict[str, Any]:
        saved = get_meta(self.agent.db("primary"), "dream_state", None) or {}
        base = {
            "last_cycle_at": None,
            "cycles": 0,
            "mini_dreams": 0,
            "last_levels": {},
            "calls": [],
            "insights": dict.fromkeys(MODES, 0),
            "last_cycle": None,
        }
        return {**base, **saved}  # type: ignore[dict-item]

    def _save(self, state: dict[str, Any]) -> None:
        db = self.agent.db("primary")
        with self.agent.lock, db:
            set_meta(db, "dream_state", state)

    def gate_state(self, state: dict[str, Any], now: float) -> GateState:
        db = self.agent.db("primary")
        since = state["last_cycle_at"] if state["last_cycle_at"] is not None else -1.0
        sessions = db.execute(
            "SELECT count(DISTINCT session_id) FROM entries WHERE session_id IS NOT NULL AND created_at > ? "
            "AND created_at <= ?",
            (since, now),
        ).fetchone()[0]
        activity = db.execute(
            "SELECT max(at) FROM (SELECT max(created_at) AS at FROM entries WHERE session_id IS NOT NULL "
            "AND created_at <= ? UNION ALL SELECT max(at) FROM memory_search_log WHERE at <= ?)",
            (now, now),
        ).fetchone()[0]
        return GateState(state["last_cycle_at"], sessions, activity)

    # -- the tick --------------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> dict[str, Any]:
        """Check the gate and the hormone rises; run a full cycle or a mini-dream if due."""
        now = self.agent.clock() if now is None else now
        state = self.state()
        levels = self.levels(now)
        risen = rises(state["last_levels"], levels, self.cfg.delta)
        state["last_levels"] = levels
        ok, reason = evaluate_gate(self.cfg, self.gate_state(state, now), now)
        if ok:
            self._save(state)
            return {"ran": "cycle", "reason": reason, **self.cycle(now)}
        if risen:
            mode = "replay" if "dopamine" in risen else "compression"
            rng = np.random.default_rng([self.seed, state["cycles"], state["mini_dreams"], 1])
            out = self._run_mode(mode, now, rng, state, levels, [])
            state["mini_dreams"] += 1
            state["insights"][mode] += out.get("insights", 0)
            self._save(state)
            return {"ran": "mini", "reason": f"{'+'.join(risen)} rose", "mode": mode, **out}
        self._save(state)
        return {"ran": None, "reason": reason}

    def cycle(self, now: float | None = None, modes: list[str] | None = None) -> dict[str, Any]:
        """One full cycle at ``now`` (``modes``: these instead of the weighted choice)."""
        now = self.agent.clock() if now is None else now
        state = self.state()
        levels = self.levels(now)
        rng = np.random.default_rng([self.seed, state["cycles"]])
        targets = curiosity.active_targets(self.agent, now)
        counts = {k: sum(t["kind"] == k for t in targets) for k in curiosity.KINDS}
        has_skills = bool(
            self.agent.db("primary")
            .execute("SELECT 1 FROM crystals WHERE lifecycle = 'frozen' LIMIT 1")
            .fetchone()
        )
        chosen = list(modes) if modes is not None else select_modes(self.cfg, counts, levels, has_skills, rng)
        unknown = [m for m in chosen if m not in MODES]
        if unknown:
            raise NimmerError(f"modes: {unknown} are not dream modes ({', '.join(MODES)})")
        state["cycle_calls"] = 0
        results = {}
        for mode in chosen:
            results[mode] = self._run_mode(mode, now, rng, state, levels, targets)
            state["insights"][mode] += results[mode].get("insights", 0)
        state.pop("cycle_calls")
        capped = self.cap_insights(now)
        state["cycles"] += 1
        state["last_cycle_at"] = now
        state["last_cycle"] = {
            "at": now,
            "modes": chosen,
            "temperature": temperature(levels),
            "results": results,
        }
        self._save(state)
        return {"modes": chosen, "results": results, "insights_capped": capped}

    def _run_mode(
        self,
        mode: str,
        now: float,
        rng: np.random.Generator,
        state: dict,
        levels: Mapping[str, float],
        targets: list,
    ) -> dict[str, Any]:
        with self.agent.lock:
            if mode == "replay":
                return self.replay(now, rng)
            if mode == "compression":
                return self.compression(now)
            return self._llm_mode(mode, now, rng, state, targets)

    # -- LLM-free modes --------------------------------------------------------------------------
    def _active(self, extra: str = "", limit: int | None = None) -> list[tuple]:
        sql = (
            f"{_COLUMNS} FROM crystals c JOIN entries e ON e.id = c.entry_id WHERE c.lifecycle IN {ACTIVE} "
            f"AND c.valid_to IS NULL AND e.semantic_type != 'insight' {extra}"
        )
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        return self.agent.db("primary").execute(sql).fetchall()

    def replay(self, now: float, rng: np.random.Generator) -> dict[str, Any]:
        """Raise the importance of the top seeds (stored score and base importance both, so the
        next rescore keeps the gain); returns the seeds and their gains."""
        rows = self._active(
            "ORDER BY c.importance * (1 + abs(e.emotional_valence)) DESC, e.id", self.cfg.replay_seeds
        )
        gains = {}
        db = self.agent.db("primary")
        with db:
            for entry_id, uid, *_ in rows:
                k = int(np.clip(rng.poisson(3), 1, 7))
                gain = 0.1 * (1 - 0.6**k) / (1 - 0.6)
                db.execute(
                    "UPDATE crystals SET importance = min(1.0, importance + ?) WHERE entry_id = ?",
                    (gain, entry_id),
                )
                db.execute(
                    "UPDATE entries SET importance = min(1.0, importance + ?) WHERE id = ?", (gain, entry_id)
                )
                gains[uid] = round(gain, 6)
        self.agent.after_commit("primary")
        return {"seeds": list(gains), "gains": gains, "insights": 0}

    def compression(self, now: float) -> dict[str, Any]:
        """Clusters of near-duplicate active crystals become one insight each (citing >= 3)."""
        rows = self._active("ORDER BY e.id DESC", self.cfg.compress_pool)
        index = self.agent.index("primary")
        rows = [r for r in rows if index.vector(r[0]) is not None]
        if len(rows) < 3:
            return {"clusters": 0, "insights": 0, "archived": 0}
        rows.sort(key=lambda r: (-r[3], r[0]))
        vectors = np.stack([index.vector(r[0]) for r in rows]).astype(np.float32)
        sims = vectors @ vectors.T
        free = np.ones(len(rows), dtype=bool)
        made, archived = [], 0
        for seed in range(len(rows)):
            if not free[seed]:
                continue
            near = np.flatnonzero(free & (sims[seed] >= self.cfg.compress_threshold))
            near = near[np.argsort(-sims[seed][near], kind="stable")][: self.cfg.compress_max]
            if len(near) < 3:
                continue
            free[near] = False
            members = [rows[i] for i in near]
            shared = set.intersection(*(set(_WORD.findall(r[2].lower())) - _STOP for r in members))
            confidence = min(0.8, 0.2 + 0.1 * min(len(members), 4) + 0.05 * min(len(shared), 6))
            words = ", ".join(sorted(shared)[:6]) or "a recurring theme"
            text = f"Recurring pattern across {len(members)} memories ({words}): {members[0][2][:200]}"
            uids = tuple(r[1] for r in members)
            insight = self._write_insight(text, uids, confidence, "compression")
            confident = confidence >= self.cfg.archive_confidence
            db = self.agent.db("primary")
            with db:
                for r in members:
                    current = db.execute(
                        "SELECT lifecycle FROM crystals WHERE entry_id = ?", (r[0],)
                    ).fetchone()[0]
                    if confident:
                        transition(db, r[0], "archived", f"compressed into {insight}", now)
                        archived += 1
                    elif current in ("generated", "activated"):
                        transition(db, r[0], "consolidated", f"compressed into {insight}", now)
            if confident:
                for r in members:
                    index.set_state(r[0], GONE)
            self.agent.after_commit("primary")
            made.append({"insight": insight, "sources": list(uids), "confidence": round(confidence, 3)})
        return {"clusters": len(made), "insights": len(made), "archived": archived, "made": made}

    def cap_insights(self, now: float) -> int:
        """Archive the least important live insights beyond ``max_insights``; returns how many."""
        with self.agent.lock:
            db = self.agent.db("primary")
            extra = db.execute(
                "SELECT entry_id FROM crystals WHERE origin = 'dream' AND lifecycle IN "
                f"{ACTIVE} ORDER BY importance DESC, entry_id DESC LIMIT -1 OFFSET ?",
                (self.cfg.max_insights,),
            ).fetchall()
            if extra:
                self.agent.move("primary", [r[0] for r in extra], "archived", "insight cap")
        return len(extra)

    def _write_insight(self, text: str, sources: tuple[str, ...], confidence: float, mode: str) -> str:
        spec = CrystalSpec(
            text=text,
            origin="dream",
            semantic_type="insight",
            importance=round(confidence * 0.7, 6),
            source_ids=sources,
        )
        db = self.agent.db("primary")
        (entry_id,) = self.agent.add([spec])
        with db:
            db.execute(
                "UPDATE crystals SET merged_from = ? WHERE entry_id = ?",
                (json.dumps(list(sources)), entry_id),
            )
        self.agent.after_commit("primary")
        return self.agent.uid("primary", entry_id)

    # -- LLM modes -------------------------------------------------------------------------------
    def _sources(self, mode: str, rng: np.random.Generator, targets: list) -> list[tuple]:
        if mode == "mutation":
            rows = self._active("ORDER BY c.importance DESC, e.id", 30)
            frozen = (
                self.agent.db("primary")
                .execute(
                    f"{_COLUMNS} FROM crystals c JOIN entries e ON e.id = c.entry_id "
                    "WHERE c.lifecycle = 'frozen' ORDER BY e.id"
                )
                .fetchall()
            )
            pool = frozen or rows
            picks = rng.choice(len(pool), size=min(3, len(pool)), replace=False) if pool else []
            return [pool[i] for i in sorted(picks)]
        if mode == "extrapolation":
            return self._active(
                "AND e.semantic_type IN ('preference', 'task_pattern', 'episode', 'goal') "
                "ORDER BY e.created_at DESC, e.id DESC",
                5,
            )
        if mode == "exploration":
            return self._active("ORDER BY c.importance DESC, e.id", 5)
        rows = self._active("ORDER BY c.importance DESC, e.id", 50)  # simulation: farthest points
        if len(rows) <= 3:
            return rows
        index = self.agent.index("primary")
        vecs = np.stack([index.vector(r[0]) for r in rows])
        chosen = [int(rng.integers(len(rows)))]
        while len(chosen) < 3:
            closest = np.max(vecs @ vecs[chosen].T, axis=1)
            closest[chosen] = np.inf
            chosen.append(int(np.argmin(closest)))
        return [rows[i] for i in chosen]

    def _budget_left(self, state: dict, now: float) -> int:
        state["calls"] = [t for t in state["calls"] if now - t < HOUR]
        return min(
            self.cfg.calls_per_cycle - state.get("cycle_calls", 0),
            self.cfg.calls_per_hour - len(state["calls"]),
        )

    def _llm_mode(
        self, mode: str, now: float, rng: np.random.Generator, state: dict, targets: list
    ) -> dict[str, Any]:
        if self.teacher is None:
            return {"skipped": "no teacher", "insights": 0, "calls": 0}
        if self._budget_left(state, now) <= 0:
            return {"skipped": "call budget spent", "insights": 0, "calls": 0}
        sources = self._sources(mode, rng, targets)
        if not sources:
            return {"skipped": "no sources", "insights": 0, "calls": 0}
        focus = sorted(targets, key=lambda t: (-t["priority"], t["id"]))[:3] if mode == "exploration" else []
        request = dream_request(mode, [r[2] for r in sources], [t["description"] for t in focus])
        state["calls"].append(now)
        state["cycle_calls"] = state.get("cycle_calls", 0) + 1
        reply = self.teacher.generate([request])[0]
        if focus:
            curiosity.mark_explored(self.agent, [t["id"] for t in focus], now)
        if reply.content is None:
            return {"error": reply.error, "insights": 0, "calls": 1}
        proposals = parse_insights(reply.content)
        kept, rejected = [], []
        if proposals:
            index = self.agent.index("primary")
            src = np.stack([index.vector(r[0]) for r in sources])
            vectors = self.agent.embedder.embed([p[0] for p in proposals])
            for (text, confidence), vec in zip(proposals, vectors, strict=True):
                if float(np.max(src @ vec)) >= self.cfg.relevance:
                    kept.append(self._write_insight(text, tuple(r[1] for r in sources), confidence, mode))
                else:
                    rejected.append(text)
        return {"insights": len(kept), "made": kept, "rejected": rejected, "calls": 1}

    # -- tools -----------------------------------------------------------------------------------
    def status(self, now: float | None = None) -> dict[str, Any]:
        """Gate state, last cycle, insight counts and the LLM call budget."""
        now = self.agent.clock() if now is None else now
        state = self.state()
        gate = self.gate_state(state, now)
        ok, reason = evaluate_gate(self.cfg, gate, now)
        calls_last_hour = sum(1 for t in state["calls"] if now - t < HOUR)
        live = (
            self.agent.db("primary")
            .execute(
                "SELECT count(*) FROM crystals c WHERE c.origin = 'dream' "
                "AND c.lifecycle NOT IN ('archived', 'expired')"
            )
            .fetchone()[0]
        )
        return {
            "gate": {"ready": ok, "reason": reason, **asdict(gate)},
            "last_cycle": state["last_cycle"],
            "cycles": state["cycles"],
            "mini_dreams": state["mini_dreams"],
            "insights": {"live": live, "made_by_mode": state["insights"]},
            "llm_calls": {
                "last_hour": calls_last_hour,
                "per_hour_budget": self.cfg.calls_per_hour,
                "per_cycle_budget": self.cfg.calls_per_cycle,
            },
            "temperature": temperature(self.levels(now)),
        }

    def search(self, query: str, max_results: int = 6, min_score: float = 0.0) -> list[dict[str, Any]]:
        """Insight crystals only, by cosine to ``query``."""
        if not query.strip():
            raise NimmerError("query: empty; say what to search for")
        with self.agent.lock:
            db = self.agent.db("primary")
            ids = [
                r[0]
                for r in db.execute(
                    "SELECT c.entry_id FROM crystals c JOIN entries e ON e.id = c.entry_id WHERE "
                    "e.semantic_type = 'insight' AND c.origin = 'dream' "
                    "AND c.lifecycle NOT IN ('archived', 'expired')"
                )
            ]
            q = self.agent.embedder.embed([query])[0]
            sims = self.agent.index("primary").similarity(q, ids)
            top = sorted((s, i) for i, s in sims.items() if s >= min_score)
            top = sorted(top, key=lambda p: (-p[0], p[1]))[:max_results]
            crystals = load(db, [i for _, i in top], "primary")
        return [{**crystals[i].public(), "similarity": round(s, 6)} for s, i in top]


def dream_request(mode: str, sources: list[str], focus: list[str]) -> Any:
    """The teacher request of one LLM mode (its ``key`` is what the replay teacher looks up)."""
    asks = {
        "mutation": "Vary these memories: what would change if one detail were different?",
        "extrapolation": "Predict what comes next, given these recent memories.",
        "simulation": "Connect these unrelated memories into one new insight.",
        "exploration": "Ask and answer what is still unknown about these open questions.",
    }
    lines = "\n".join(f"- {s}" for s in sources)
    if focus:
        lines += "\nOpen questions:\n" + "\n".join(f"- {f}" for f in focus)
    messages = [
        {
            "role": "system",
            "content": "You are the dreaming mind of a game character. Answer with JSON: "
            '{"insights": [{"text": "...", "confidence": 0.0-1.0}]}.',
        },
        {"role": "user", "content": f"{asks[mode]}\nMemories:\n{lines}"},
    ]
    knobs = SamplingKnobs(
        temperature=0.9, top_p=0.95, top_k=50, repetition_penalty=1.05, min_p=0.0, max_new_tokens=200
    )
    prompt = TurnPrompt(
        role="dream engine",
        trait_vector={},
        affect_state=AffectState("dreaming"),
        memory_scope=MemoryScope(("primary",), tuple(sources)),
        turn_intent=mode,
        zone_context="sleep",
    )
    return GenerationRequest("dream", {"mode": mode}, prompt, messages, knobs, request_key(messages, knobs))


def parse_insights(content: str) -> list[tuple[str, float]]:
    """(text, confidence) pairs from a reply: the JSON the prompt asks for, else one per line."""
    try:
        data = json.loads(content)
        items = data.get("insights", []) if isinstance(data, dict) else data
        out = []
        for item in items:
            if isinstance(item, dict) and str(item.get("text", "")).strip():
                out.append(
                    (str(item["text"]).strip(), float(min(1.0, max(0.0, item.get("confidence", 0.5)))))
                )
            elif isinstance(item, str) and item.strip():
                out.append((item.strip(), 0.5))
        return out
    except (json.JSONDecodeError, TypeError, ValueError, AttributeError):
        return [(line.strip("- ").strip(), 0.5) for line in content.splitlines() if line.strip("- ").strip()]


def with_weights(cfg: DreamConfig, **weights: float) -> DreamConfig:
    return replace(cfg, weights={**cfg.weights, **weights})


def show_cycle(engine: DreamEngine, modes: list[str] | None = None) -> list[str]:
    """Run one full cycle now and describe its insights in lines (the demo prints them)."""
    out = engine.cycle(modes=modes)
    lines = [f"dream cycle: modes {out['modes']}"]
    for mode, result in out["results"].items():
        made = result.get("made", [])
        uids = [m["insight"] if isinstance(m, dict) else m for m in made]
        for insight in engine.agent.crystals(
            where=f"e.event_uid IN ({', '.join('?' * len(uids))})", params=uids
        ):
            lines.append(f"  {mode} insight from {len(insight.merged_from)} sources: {insight.text[:110]!r}")
        if "seeds" in result:
            lines.append(f"  replay: {len(result['seeds'])} important memories reinforced")
        elif not made:
            lines.append(f"  {mode}: { ({k: v for k, v in result.items() if k != 'made'}) }")
    return lines
