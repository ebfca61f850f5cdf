"""Hormones (issue 17): golden values at rest and after each event, the half-life algebra
(property-tested), caps, persistence across reopen, event detection from turns, bad input, and
how they modulate memory processing (composing with valence, neutral at rest)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimmer_train.agent.consolidation import DEFAULT_POLICY, hormonal_policy
from nimmer_train.agent.hormones import (
    EVENTS,
    HALF_LIFE_S,
    HORMONES,
    REST,
    STORE,
    Hormones,
    Modulation,
    decay,
)
from nimmer_train.agent.importance import importance
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import connect
from tests.helpers.memory import Clock, agent_memory

T0 = 1_800_000_000.0


@pytest.fixture
def hormones(tmp_path: Path) -> Hormones:
    h = Hormones(tmp_path, Clock(T0))
    yield h
    h.close()


def test_golden_values_at_rest(hormones: Hormones) -> None:
    state = hormones.state(T0)
    assert {n: state[n] for n in HORMONES} == {"dopamine": 0.15, "cortisol": 0.02, "oxytocin": 0.2}
    assert state["tone"] == pytest.approx(
        {
            "warmth": 0.30,
            "energy": 0.225,
            "focus": 0.03,
            "playfulness": 0.1386,
            "verbosity": 0.134,
            "curiosityExpression": 0.369,
            "assertiveness": 0.34,
            "empathyExpression": 0.36,
        }
    )
    assert state["responseGuidance"] == ["keep it brief and to the point"]
    assert state["emotionalBriefing"] == "Subtle emotional undertones: faint satisfaction, gentle warmth."
    assert (state["mood"], state["trajectory"]) == ("calm", "steady")
    assert hormones.modulation(T0) == Modulation()  # neutral at rest
    assert hormones.affect_shift(T0) == (0.0, 0.0) and hormones.prompt_hints(T0) == []


# event -> (dopamine, cortisol, oxytocin), energy, warmth, focus, mood, guidance, prompt hints
GOLDEN = {
    "reward": ((0.45, 0.02, 0.2), 0.675, 0.3, 0.03, "content", ["be enthusiastic and celebrate wins"]),
    "achievement": (
        (0.55, 0.02, 0.4),
        0.825,
        0.6,
        0.03,
        "elated",
        ["be enthusiastic and celebrate wins", "be warm and personal", "allow some playfulness"],
    ),
    "error": ((0.15, 0.32, 0.2), 0.225, 0.3, 0.48, "stressed", ["be concise and action-oriented"]),
    "urgency": ((0.15, 0.42, 0.2), 0.225, 0.3, 0.63, "stressed", ["be concise and action-oriented"]),
    "social": ((0.15, 0.02, 0.5), 0.225, 0.75, 0.03, "affectionate", ["be warm and personal"]),
    "curiosity_progress": (
        (0.35, 0.02, 0.2),
        0.525,
        0.3,
        0.03,
        "content",
        ["be enthusiastic and celebrate wins"],
    ),
}


@pytest.mark.parametrize("event", EVENTS)
def test_golden_values_after_each_event(tmp_path: Path, event: str) -> None:
    levels, energy, warmth, focus, mood, hints = GOLDEN[event]
    h = Hormones(tmp_path, Clock(T0))
    after = h.spike(event, T0)
    assert [after[n] for n in HORMONES] == pytest.approx(levels, abs=1e-12)
    state = h.state(T0)
    assert (state["tone"]["energy"], state["tone"]["warmth"], state["tone"]["focus"]) == pytest.approx(
        (energy, warmth, focus)
    )
    assert (state["mood"], state["trajectory"]) == (mood, "rising")  # just spiked
    assert h.state(T0 + 3600)["trajectory"] == "falling"  # settling back toward rest
    assert h.state(T0 + 12 * 3600)["trajectory"] == "steady"
    assert h.prompt_hints(T0) == hints
    for hint in h.prompt_hints(T0):  # tone hints only: no emotion is named to the model
        assert not any(w in hint for w in ("happy", "feel", "stress", "anxious", "satisf", "love"))
    h.close()


@pytest.mark.parametrize("name", HORMONES)
def test_one_half_life_moves_exactly_halfway_to_rest(tmp_path: Path, name: str) -> None:
    h = Hormones(tmp_path, Clock(T0))
    event = {"dopamine": "reward", "cortisol": "urgency", "oxytocin": "social"}[name]
    peak = h.spike(event, T0)[name]
    half = h.levels(T0 + HALF_LIFE_S[name])[name]
    assert half - REST[name] == pytest.approx((peak - REST[name]) / 2, rel=1e-12)
    assert h.levels(T0 + 20 * HALF_LIFE_S[name])[name] == pytest.approx(REST[name], abs=1e-5)
    assert h.levels(T0 + 10 * 3600)[name] >= REST[name]  # toward rest, never below it (not zero)
    h.close()


@settings(max_examples=60, deadline=None)
@given(
    st.floats(0, 1),
    st.sampled_from(HORMONES),
    st.floats(0, 6 * 3600),
    st.floats(0, 6 * 3600),
)
def test_decay_over_a_then_b_equals_decay_over_a_plus_b(v0: float, name: str, a: float, b: float) -> None:
    rest, half = REST[name], HALF_LIFE_S[name]
    assert decay(decay(v0, rest, half, a), rest, half, b) == pytest.approx(
        decay(v0, rest, half, a + b), abs=1e-12
    )


@settings(max_examples=15, deadline=None)
@given(st.sampled_from(EVENTS), st.floats(1, 4 * 3600), st.floats(1, 4 * 3600))
def test_the_store_rebases_without_bending_the_curve(
    tmp_path_factory: pytest.TempPathFactory, event: str, a: float, b: float
) -> None:
    """A zero-intensity event at t0 + a writes the decayed levels back; at t0 + a + b the
    re-based store reads what one uninterrupted decay from t0 gives (and a reopen changes nothing)."""
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    rebased, plain = Hormones(one, Clock(T0)), Hormones(two, Clock(T0))
    rebased.spike(event, T0)
    plain.spike(event, T0)
    rebased.spike(event, T0 + a, intensity=0.0)
    rebased.close()
    reopened = Hormones(one, Clock(T0))
    got, want = reopened.levels(T0 + a + b), plain.levels(T0 + a + b)
    assert got == pytest.approx(want, abs=1e-12)
    reopened.close()
    plain.close()


def test_spikes_are_capped(hormones: Hormones) -> None:
    for _ in range(5):
        levels = hormones.spike("achievement", T0)
    assert levels["dopamine"] == 1.0 and levels["oxytocin"] == 1.0  # 0.15 + 5 x 0.4, capped
    for _ in range(4):
        levels = hormones.spike("urgency", T0)
    assert levels["cortisol"] == 1.0
    state = hormones.state(T0)
    assert all(0.0 <= v <= 1.0 for v in state["tone"].values())
    assert hormones.levels(T0 + 1800)["dopamine"] == pytest.approx(REST["dopamine"] + (1 - 0.15) / 2)


def test_levels_persist_across_reopen_in_a_versioned_store(tmp_path: Path) -> None:
    h = Hormones(tmp_path, Clock(T0))
    reader = Hormones(tmp_path, Clock(T0))  # another connection on the folder (the agent's status)
    assert reader.levels(T0)["dopamine"] == 0.15
    h.spike("reward", T0)
    h.spike("error", T0 + 600)
    expected = h.levels(T0 + 3600)
    assert reader.levels(T0 + 3600) == pytest.approx(expected, abs=1e-12)  # sees the other's commits
    reader.close()
    h.close()
    again = Hormones(tmp_path, Clock(T0 + 3600))
    assert again.levels() == pytest.approx(expected, abs=1e-12)  # the clock's now
    events = again.db.execute("SELECT event, at FROM hormone_events ORDER BY id").fetchall()
    assert events == [("reward", T0), ("error", T0 + 600)]
    assert again.db.execute("PRAGMA user_version").fetchone()[0] == 1
    again.close()
    db = connect(tmp_path / STORE)
    db.execute("PRAGMA user_version=7")
    db.close()
    with pytest.raises(NimmerError, match="schema version 7"):
        Hormones(tmp_path, Clock(T0))


@pytest.mark.parametrize(
    ("line", "events"),
    [
        ("Well done, here's your reward.", ["reward"]),
        ("We did it! The quest complete at last.", ["achievement"]),
        ("You fool, the pump is broken and it's your mistake.", ["error"]),
        ("Hurry, they're coming for the gate!", ["urgency"]),
        ("You're my friend, I trust you.", ["social"]),
        ("I found the missing ledger, now I understand.", ["curiosity_progress"]),
        ("Thank you, friend.", ["reward", "social"]),
        ("Where did the water go?", []),
        ("The rundown shack by the unbroken wall.", []),
    ],
)
def test_events_are_detected_from_turn_text(line: str, events: list[str]) -> None:
    assert Hormones.detect(line) == events


def test_react_spikes_game_events_and_detected_ones_once(hormones: Hormones) -> None:
    fired = hormones.react("Well done! A reward for you.", ("reward", "urgency"), T0)
    assert fired == ["reward", "urgency"]  # the text's reward is the game's: counted once
    assert hormones.levels(T0)["dopamine"] == pytest.approx(0.45)


def test_bad_input_is_refused_clearly(hormones: Hormones) -> None:
    with pytest.raises(NimmerError, match="'bribe' is not one of reward"):
        hormones.spike("bribe", T0)
    with pytest.raises(NimmerError, match="intensity 1.5 is outside"):
        hormones.spike("reward", T0, intensity=1.5)
    peak = hormones.spike("reward", T0)
    assert hormones.levels(T0 - 60) == peak  # another process's earlier clock: no decay, no rise


def test_modulation_composes_with_valence_and_is_neutral_at_rest(tmp_path: Path) -> None:
    clock = Clock(T0)
    agent = agent_memory(tmp_path / "agent", clock)
    assert hormonal_policy(agent, T0, DEFAULT_POLICY) is DEFAULT_POLICY  # at rest: unchanged
    assert agent.search_weights(T0) == agent.weights
    agent.hormones.spike("urgency", T0)
    agent.hormones.spike("reward", T0)
    stressed = hormonal_policy(agent, T0, DEFAULT_POLICY)
    assert stressed.merge_threshold == pytest.approx(DEFAULT_POLICY.merge_threshold + 0.03 * 0.4)
    resistance = min(0.5, 0.3 * 0.42 + 0.2 * 0.45 + 0.2 * 0.2) - (0.3 * 0.02 + 0.2 * 0.15 + 0.2 * 0.2)
    assert stressed.importance.half_life_s == pytest.approx(
        DEFAULT_POLICY.importance.half_life_s / (1 - resistance)
    )
    # valence keeps its own resistance under the hormones: both factors multiply the rate
    day60 = 60 * 86400.0
    calm = [importance("fact", 0, day60, v, policy=DEFAULT_POLICY.importance) for v in (0.0, 1.0)]
    tense = [importance("fact", 0, day60, v, policy=stressed.importance) for v in (0.0, 1.0)]
    assert tense[1] > tense[0] and calm[1] > calm[0] and tense[0] > calm[0] and tense[1] > calm[1]
    rate = math.log(2) / DEFAULT_POLICY.importance.half_life_s
    assert tense[1] == pytest.approx(
        2 * 0.5 * (1 - math.exp(-0.2)) * math.exp(-rate * 0.5 * (1 - resistance) * day60)
    )
    w = agent.search_weights(T0)
    assert w.importance == pytest.approx(agent.weights.importance * (1 + 0.2 * 0.45) / (1 + 0.2 * 0.15))
    assert w.recency == pytest.approx(agent.weights.recency * (1 + 0.3 * 0.42) / (1 + 0.3 * 0.02))
    assert dataclasses.replace(w, importance=0.5, recency=1.0) == agent.weights  # nothing else moves
    status = agent.memory_status()["hormonalState"]
    assert status["mood"] == "stressed" and status["cortisol"] == pytest.approx(0.42)
    clock.now = T0 + 12 * 3600  # half a day later: at rest again, weights as configured
    later = agent.search_weights(clock.now)
    assert later.importance == pytest.approx(0.5, rel=1e-4) and later.recency == pytest.approx(1.0, rel=1e-4)
    assert agent.memory_status()["hormonalState"]["mood"] == "calm"
    agent.close()


def test_a_day_of_events_replays_identically(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Determinism (item 5): every time is the injected clock's; the same day gives the same states."""
    import time

    monkeypatch.setattr(time, "time", lambda: pytest.fail("read the wall clock"))
    script = [(300.0, "social"), (2400.0, "error"), (2500.0, "urgency"), (9000.0, "reward"), (30000.0, None)]

    def day(folder: Path) -> list[dict[str, object]]:
        clock = Clock(T0)
        h = Hormones(folder, clock)
        states = []
        for at, event in script:
            clock.now = T0 + at
            if event:
                h.react(f"a turn with a {event}", (event,))
            states.append(h.state())
        h.close()
        return states

    assert day(tmp_path / "one") == day(tmp_path / "two")
