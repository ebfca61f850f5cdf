"""The curiosity engine: three low-scoring searches make exactly one knowledge-gap target,
resolving removes it, 48 h expire it; region ids survive a rebuild and a permutation; slot
contradictions and the 10-target cap; consolidation rebuilds it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nimmer_train.agent import curiosity
from nimmer_train.agent.consolidation import consolidate
from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.errors import NimmerError
from tests.helpers.memory import Clock, agent_memory

HOUR = 3600.0
THEMES = [
    "the blacksmith forges silver blades at the east gate",
    "the river ferry leaves at dawn carrying salt and wool",
    "the mayor hides ledgers of stolen grain under the floor",
]


def _themes(agent, suffixes=(" today", " again", " once more", " at noon")) -> None:  # noqa: ANN001
    agent.add([CrystalSpec(text=t + s, origin="note") for t in THEMES for s in suffixes])


def test_three_low_searches_make_one_gap_resolve_removes_and_48h_expire(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _themes(agent)
    for query in ("dragon eggs", "the moon tax"):
        agent.memory_search(query, min_score=0.9)
    curiosity.run(agent, clock.now)
    assert curiosity.curiosity_state(agent)["counts"]["knowledge_gap"] == 0  # two are not enough
    agent.memory_search("glass owls of the north", min_score=0.9)
    agent.memory_search("the blacksmith forges silver blades at the east gate today")  # a good one
    curiosity.run(agent, clock.now)
    curiosity.run(agent, clock.now)  # a second run finds nothing new
    gaps = [t for t in curiosity.curiosity_state(agent)["targets"] if t["kind"] == "knowledge_gap"]
    assert len(gaps) == 1 and len(gaps[0]["queries"]) == 3
    dopamine = agent.hormones.levels(clock.now)["dopamine"]
    assert curiosity.curiosity_resolve(agent, gaps[0]["id"])["resolved"] == gaps[0]["id"]
    assert agent.hormones.levels(clock.now)["dopamine"] > dopamine  # curiosity progress rewards
    assert curiosity.curiosity_state(agent)["counts"]["knowledge_gap"] == 0
    with pytest.raises(NimmerError, match="targetId"):
        curiosity.curiosity_resolve(agent, gaps[0]["id"])
    for query in ("a", "b", "c"):
        agent.memory_search(f"unknown {query} thing", min_score=0.9)
    curiosity.run(agent, clock.now)
    assert curiosity.curiosity_state(agent)["counts"]["knowledge_gap"] == 1
    clock.now += 48 * HOUR - 1
    assert curiosity.curiosity_state(agent)["counts"]["knowledge_gap"] == 1
    clock.now += 1
    assert curiosity.curiosity_state(agent)["counts"]["knowledge_gap"] == 0
    curiosity.run(agent, clock.now)
    (expired,) = [t for t in agent_targets(agent) if t.get("expired_at") is not None]
    assert expired["kind"] == "knowledge_gap" and expired["expired_at"] == clock.now


def agent_targets(agent) -> list[dict]:  # noqa: ANN001
    from nimmer_train.memory.db import get_meta

    return get_meta(agent.db("primary"), "curiosity_targets", [])  # type: ignore[return-value]


def test_region_ids_stay_stable_across_rebuilds_and_growth(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _themes(agent)
    curiosity.run(agent, clock.now)
    first = {r["id"]: r["size"] for r in curiosity.curiosity_state(agent)["regions"]}
    assert len(first) == 3 and set(first.values()) == {4}
    clock.now += HOUR
    agent.add([CrystalSpec(text=THEMES[0] + " at dusk", origin="note")])  # one region grows
    curiosity.run(agent, clock.now)
    second = {r["id"]: r["size"] for r in curiosity.curiosity_state(agent)["regions"]}
    assert set(second) == set(first) and sorted(second.values()) == [4, 4, 5]


def test_cluster_is_permutation_stable_on_separated_groups() -> None:
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(3, 16))
    points = np.concatenate([c + 0.05 * rng.normal(size=(5, 16)) for c in centres])
    points /= np.linalg.norm(points, axis=1, keepdims=True)
    order = rng.permutation(len(points))
    a = {frozenset(g) for g in curiosity.cluster(points, 0.7)}
    b = {frozenset(int(order[i]) for i in g) for g in curiosity.cluster(points[order], 0.7)}
    assert a == b and len(a) == 3


def test_contradiction_and_cap_and_consolidation_rebuild(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path / "a", clock)
    _themes(agent)
    agent.add(
        [
            CrystalSpec(text="Greta lives in Oakvale by the mill", origin="note"),
            CrystalSpec(text="Greta lives in Stonebridge now", origin="note"),
        ]
    )
    report = consolidate(agent, clock.now)
    assert report["curiosity"]["regions"] == 3
    (target,) = [t for t in curiosity.curiosity_state(agent)["targets"] if t["kind"] == "contradiction"]
    assert target["key"] == "greta lives in" and len(target["sources"]) == 2
    agent.add([CrystalSpec(text=f"Person{i} lives in Town{i}a", origin="note") for i in range(12)])
    agent.add([CrystalSpec(text=f"Person{i} lives in Town{i}b", origin="note") for i in range(12)])
    curiosity.run(agent, clock.now)
    state = curiosity.curiosity_state(agent)
    assert len(state["targets"]) == 10 and all(t["kind"] == "contradiction" for t in state["targets"])
