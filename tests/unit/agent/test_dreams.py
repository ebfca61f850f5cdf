"""The dream engine: the gate's cases, each mode's effect on the store, seeded mode frequencies
(chi-square), the LLM modes against the loopback OpenAI-compatible stand-in (a third-party server
that cannot run here) and against the replay teacher, and a seeded day that replays identically."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from scipy.stats import chisquare

from nimmer_train.agent import curiosity
from nimmer_train.agent.crystals import ACTIVE, CrystalSpec
from nimmer_train.agent.dreams import (
    MODES,
    DreamConfig,
    DreamEngine,
    GateState,
    dream_request,
    evaluate_gate,
    mode_weights,
    probabilities,
    rises,
    select_modes,
    temperature,
)
from nimmer_train.agent.tools import memory_tools
from nimmer_train.config.teacher import TeacherConfig
from nimmer_train.synth.teacher.backends import OpenAICompatible, Replay
from tests.helpers.llm_server import LLMServer, serve
from tests.helpers.memory import Clock, agent_memory

HOUR = 3600.0
CFG = DreamConfig()
TOPICS = [
    "the blacksmith Ilse forges silver blades at the east gate",
    "the river ferry leaves at dawn carrying salt and wool",
    "a grey cat sleeps on the warm stones of the old chapel",
    "the mayor hides ledgers of stolen grain under the floor",
    "lanterns on the harbour wall burn green during festivals",
]


def _fill(agent, n_sessions: int = 2) -> list[int]:  # noqa: ANN001
    specs = [
        CrystalSpec(
            text=f"{t} (told in session {s})",
            origin="transcript",
            session_id=f"s{s}",
            importance=0.3 + 0.1 * i,
        )
        for s in range(n_sessions)
        for i, t in enumerate(TOPICS)
    ]
    return agent.add(specs)


# -- the gate ------------------------------------------------------------------------------------
def test_gate_cases_are_the_three_conditions() -> None:
    now = 100 * HOUR
    assert evaluate_gate(CFG, GateState(None, 1, now - 2 * HOUR), now)[0]
    assert not evaluate_gate(CFG, GateState(None, 0, now - 2 * HOUR), now)[0]  # no new session
    assert not evaluate_gate(CFG, GateState(None, 1, now - 30 * 60), now)[0]  # not idle 60 min
    assert not evaluate_gate(CFG, GateState(now - 7 * HOUR, 1, now - 2 * HOUR), now)[0]  # < 8 h
    assert evaluate_gate(CFG, GateState(now - 8 * HOUR, 1, now - HOUR), now)[0]  # edges pass


def test_rise_fires_once_and_a_pinned_hormone_never_again() -> None:
    assert rises({"dopamine": 0.5}, {"dopamine": 0.7}, 0.15) == ["dopamine"]
    assert rises({"dopamine": 0.9}, {"dopamine": 0.9}, 0.15) == []
    assert rises({"cortisol": 0.5}, {"cortisol": 0.6}, 0.15) == []


def test_idle_day_runs_nothing_and_pinned_dopamine_fires_once(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _fill(agent)
    engine = DreamEngine(agent, hormones={"dopamine": 0.1, "cortisol": 0.1, "oxytocin": 0.1})
    first = engine.tick()  # sessions are new but the agent is not idle yet
    assert first["ran"] is None
    clock.now += 2 * HOUR
    assert engine.tick()["ran"] == "cycle"
    ran = []
    for _ in range(48):  # an idle day in 30-minute ticks: no session, no rise
        clock.now += 1800
        ran.append(engine.tick()["ran"])
    assert ran == [None] * 48
    pinned = DreamEngine(agent, hormones={"dopamine": 0.9, "cortisol": 0.1, "oxytocin": 0.1})
    fired = []
    for _ in range(48):
        clock.now += 1800
        fired.append(pinned.tick()["ran"])
    assert fired.count("mini") == 1 and fired[0] == "mini"
    status = pinned.status()
    assert status["cycles"] == 1 and status["mini_dreams"] == 1 and not status["gate"]["ready"]


def test_restart_keeps_the_counters(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _fill(agent)
    clock.now += 2 * HOUR
    assert DreamEngine(agent).tick()["ran"] == "cycle"
    agent.close()
    clock.now += 4 * HOUR
    again = agent_memory(tmp_path / "a", clock)
    engine = DreamEngine(again)
    state = engine.state()
    assert state["cycles"] == 1 and state["last_cycle_at"] == clock.now - 4 * HOUR
    again.add([CrystalSpec(text="a new session line", origin="transcript", session_id="s9")])
    clock.now += 2 * HOUR
    assert engine.tick()["ran"] is None  # 6 h since the last cycle: the restart did not reset it
    clock.now += 3 * HOUR
    assert engine.tick()["ran"] == "cycle"


# -- the modes -----------------------------------------------------------------------------------
def test_replay_raises_only_its_seeds(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path / "a")
    ids = _fill(agent)
    db = agent.db("primary")
    before = dict(db.execute("SELECT entry_id, importance FROM crystals"))
    out = DreamEngine(agent, config=DreamConfig(replay_seeds=3)).replay(
        agent.clock(), np.random.default_rng(1)
    )
    after = dict(db.execute("SELECT entry_id, importance FROM crystals"))
    seeds = {agent.crystals(where="e.event_uid = ?", params=(u,))[0].entry_id for u in out["seeds"]}
    assert len(seeds) == 3
    for entry_id in ids:
        if entry_id in seeds:
            gain = out["gains"][agent.uid("primary", entry_id)]
            assert gain in {round(0.1 * (1 - 0.6**k) / 0.4, 6) for k in range(1, 8)}
            assert after[entry_id] == pytest.approx(min(1.0, before[entry_id] + gain))
        else:
            assert after[entry_id] == before[entry_id]


def test_compression_lowers_active_count_and_cites_three_sources(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path / "a")
    variants = ["", " again", " once more", " today"]
    agent.add(
        [
            CrystalSpec(text=f"{t}{v}", origin="transcript", session_id="s0")
            for t in TOPICS[:2]
            for v in variants
        ]
    )
    agent.add([CrystalSpec(text="an unrelated note about tax law in distant lands", origin="note")])
    count = f"SELECT count(*) FROM crystals WHERE lifecycle IN {ACTIVE}"
    active_before = agent.db("primary").execute(count).fetchone()[0]
    out = DreamEngine(agent).compression(agent.clock())
    active_after = agent.db("primary").execute(count).fetchone()[0]
    assert out["insights"] == 2 and active_after < active_before
    insights = agent.crystals(where="c.origin = 'dream'")
    assert len(insights) == 2
    for insight in insights:
        assert insight.semantic_type == "insight" and len(insight.merged_from) >= 3
        sources = agent.crystals(
            where=f"e.event_uid IN ({','.join('?' * len(insight.merged_from))})", params=insight.merged_from
        )
        assert {s.lifecycle for s in sources} == {"archived"}  # confident: sources archived
    capped = DreamEngine(agent, config=DreamConfig(max_insights=1)).cycle(modes=["replay"])
    assert (
        capped["insights_capped"] == 1
        and len(agent.crystals(where=f"c.origin = 'dream' AND c.lifecycle IN {ACTIVE}")) == 1
    )


def _dream_answer(text_for):  # noqa: ANN001, ANN202
    def answer(body: dict) -> str:
        return json.dumps({"insights": [{"text": text_for(body), "confidence": 0.9}]})

    return answer


def _teacher(server: LLMServer) -> OpenAICompatible:
    return OpenAICompatible(
        TeacherConfig(backend="openai_compatible", base_url=server.url + "/v1", max_retries=0, timeout_s=10)
    )


def test_relevance_gate_keeps_a_close_insight_and_rejects_an_off_topic_one(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path / "a")
    _fill(agent, 1)
    proposals = [
        {
            "text": "the blacksmith Ilse forges silver blades at the east gate for the mayor",
            "confidence": 0.8,
        },
        {"text": "zzqx vvk ptth 99 ### qqq jjj", "confidence": 0.8},
    ]
    with serve(lambda body: json.dumps({"insights": proposals})) as on_topic:
        engine = DreamEngine(agent, teacher=_teacher(on_topic))
        out = engine.cycle(modes=["simulation"])["results"]["simulation"]
    assert out["calls"] == 1 and out["insights"] == 1 and out["rejected"] == ["zzqx vvk ptth 99 ### qqq jjj"]
    (insight,) = agent.crystals(where="c.origin = 'dream'")
    assert len(insight.merged_from) == 3 and insight.semantic_type == "insight"
    found = memory_tools(agent, dreams=engine).call("dream_search", {"query": "silver blades"})["results"]
    assert [r["id"] for r in found] == [insight.id]  # insights only: the sources are not listed


def test_call_budgets_cap_llm_modes(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path / "a")
    _fill(agent, 1)
    with serve(_dream_answer(lambda body: "the river ferry leaves at dawn carrying salt")) as server:
        engine = DreamEngine(
            agent, teacher=_teacher(server), config=DreamConfig(calls_per_cycle=2, calls_per_hour=3)
        )
        first = engine.cycle(modes=["simulation", "mutation", "extrapolation"])["results"]
        second = engine.cycle(modes=["simulation", "mutation"])["results"]
    assert [first[m]["calls"] for m in ("simulation", "mutation", "extrapolation")] == [1, 1, 0]
    assert [second[m]["calls"] for m in ("simulation", "mutation")] == [1, 0]  # the hour's 3 are spent
    assert len(server.requests) == 3
    assert engine.status()["llm_calls"]["last_hour"] == 3


def test_replay_teacher_answers_exploration_and_targets_are_marked_explored(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _fill(agent, 1)
    for q in ("dragon eggs", "moon tax", "glass owls"):
        agent.memory_search(q, min_score=0.9)
    curiosity.run(agent, clock.now)
    (target,) = curiosity.active_targets(agent, clock.now)
    sources = [r[2] for r in DreamEngine(agent)._active("ORDER BY c.importance DESC, e.id", 5)]
    request = dream_request("exploration", sources, [target["description"]])
    replay_file = tmp_path / "replay.jsonl"
    content = json.dumps({"insights": [{"text": "the mayor hides stolen grain ledgers", "confidence": 0.7}]})
    replay_file.write_text(json.dumps({"key": request.key, "response": {"content": content}}) + "\n")
    teacher = Replay(TeacherConfig(backend="replay", replay_file=str(replay_file)))
    out = DreamEngine(agent, teacher=teacher).cycle(modes=["exploration"])["results"]["exploration"]
    assert out["insights"] == 1
    (after,) = curiosity.active_targets(agent, clock.now)
    assert after["explored_at"] == clock.now and after["resolved_at"] is None


# -- mode selection ------------------------------------------------------------------------------
def test_mode_frequencies_match_the_weights_chi_square() -> None:
    levels = {"dopamine": 0.0, "cortisol": 0.0, "oxytocin": 0.0}  # T = 1: p equals the weights
    assert temperature(levels) == 1.0
    rng = np.random.default_rng(7)
    p = probabilities(mode_weights(CFG, {}), 1.0)
    draws = rng.choice(len(MODES), size=4000, p=p)
    first = [select_modes(DreamConfig(max_modes=1), {}, levels, False, rng)[0] for _ in range(2000)]
    observed = np.bincount([MODES.index(m) for m in first], minlength=len(MODES))
    expected = np.array([CFG.weights[m] for m in MODES]) / sum(CFG.weights.values()) * 2000
    assert chisquare(observed, expected).pvalue > 0.01
    assert chisquare(np.bincount(draws, minlength=len(MODES)), p * 4000).pvalue > 0.01
    hot = probabilities(mode_weights(CFG, {}), temperature({"dopamine": 1.0}))
    assert hot.max() - hot.min() < p.max() - p.min()  # dopamine flattens the choice


def test_exploration_is_chosen_whenever_gaps_are_open() -> None:
    rng = np.random.default_rng(3)
    for _ in range(500):
        assert "exploration" in select_modes(CFG, {"knowledge_gap": 1}, {}, False, rng)
    assert mode_weights(CFG, {"knowledge_gap": 2})["exploration"] == pytest.approx(0.25)


# -- determinism ---------------------------------------------------------------------------------
def _day(folder: Path) -> list:
    clock = Clock()
    agent = agent_memory(folder, clock)
    echo = _dream_answer(
        lambda body: body["messages"][1]["content"].split("- ")[1].split("\n")[0] + " in time"
    )
    levels = {"dopamine": 0.2, "cortisol": 0.1, "oxytocin": 0.3}
    with serve(echo) as server:
        engine = DreamEngine(agent, hormones=lambda now: levels, teacher=_teacher(server), seed=11)
        log = []
        for hour in range(24):
            clock.now += HOUR
            if hour in (1, 12):
                _fill(agent, 1 + hour % 3)
            if hour == 15:
                levels = {**levels, "dopamine": 0.6}
            log.append(engine.tick())
    rows = (
        agent.db("primary")
        .execute(
            "SELECT e.event_uid, e.text, c.importance, c.lifecycle, c.merged_from FROM entries e "
            "JOIN crystals c ON c.entry_id = e.id ORDER BY e.id"
        )
        .fetchall()
    )
    agent.close()
    # event uids are random (uuid4, as every store writes them): compare by position instead
    text = json.dumps([log, [r[1:] for r in rows]])
    for n, row in enumerate(rows):
        text = text.replace(row[0], f"#{n}")
    return json.loads(text)


def test_a_seeded_day_replays_identically(tmp_path: Path) -> None:
    day_a, day_b = _day(tmp_path / "a"), _day(tmp_path / "b")
    ran = [e["ran"] for e in day_a[0]]
    assert ran.count("cycle") >= 2 and "mini" in ran
    assert any(r.get("insights") for e in day_a[0] for r in e.get("results", {}).values())
    assert day_a == day_b


def test_tools_report_dream_and_curiosity_state(tmp_path: Path) -> None:
    agent = agent_memory(tmp_path / "a")
    tools = memory_tools(agent, dreams=True)
    status = tools.call("dream_status")
    assert status["cycles"] == 0 and status["gate"]["ready"] is False
    assert tools.call("curiosity_state")["targets"] == []
    with pytest.raises(Exception, match="targetId"):
        tools.call("curiosity_resolve", {"targetId": "nope"})
    status = agent.memory_status()
    assert status["dreams"]["cycles"] == 0 and status["curiosity"] == {"targets": [], "regions": 0}


def test_the_agents_own_hormones_drive_mini_dreams(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _fill(agent, 1)
    engine = DreamEngine(agent)  # no levels given: reads agent.hormones
    assert engine.tick()["ran"] is None  # at rest: nothing rose
    agent.hormones.spike("achievement", clock.now)
    clock.now += 60
    out = engine.tick()
    assert out["ran"] == "mini" and out["mode"] == "replay" and len(out["seeds"]) == 5
    clock.now += 60
    assert engine.tick()["ran"] is None  # still high, no new rise
