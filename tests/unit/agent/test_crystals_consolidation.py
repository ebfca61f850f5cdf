"""Consolidation: forget, purge, merge (and its MiniLM calibration), TTL, stalled goals, frozen
skills, idempotence, a kill mid-run, the scheduler and the on-demand CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.agent.consolidation import DEFAULT_POLICY, consolidate, minimal_pair
from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.scheduler import ConsolidationScheduler, consolidation_lock, run_once
from nimmer_train.cli import main as cli_main
from nimmer_train.memory.db import integrity_ok
from tests.helpers import REPO
from tests.helpers.memory import Clock, agent_memory
from tests.helpers.merge_pairs import PARAPHRASES, RELATED

DAY = 86400.0
TABLES = (
    "SELECT * FROM entries ORDER BY id",
    "SELECT * FROM crystals ORDER BY entry_id",
    "SELECT * FROM crystal_audit",
)


def _snapshot(agent) -> list:  # noqa: ANN001
    return [agent.db("primary").execute(sql).fetchall() for sql in TABLES]


def test_forget_audits_and_a_second_run_at_the_same_now_changes_nothing(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    old, kept, cornerstone = agent.add(
        [
            CrystalSpec("an idle remark about the weather", "note"),
            CrystalSpec("the well is poisoned", "note", emotional_valence=-1.0),
            CrystalSpec("the day the river took my father", "note", memory_class="cornerstone"),
        ]
    )
    clock.now += 60 * DAY  # past 51 days (forgotten) but not 102 (|valence| = 1)
    report = consolidate(agent)
    assert report["primary"]["forgotten"] == 1
    states = dict(agent.db("primary").execute("SELECT entry_id, lifecycle FROM crystals"))
    assert states == {old: "expired", kept: "generated", cornerstone: "generated"}
    reason = (
        agent.db("primary")
        .execute("SELECT reason FROM crystal_audit WHERE entry_id = ? AND to_state = 'expired'", (old,))
        .fetchone()[0]
    )
    assert reason.startswith("forgotten")
    before = _snapshot(agent)
    again = consolidate(agent)
    assert _snapshot(agent) == before
    assert all(v == 0 for v in again["primary"].values())  # type: ignore[union-attr]
    clock.now += DEFAULT_POLICY.retention_s + 1
    assert consolidate(agent)["primary"]["purged"] == 1  # type: ignore[index]
    assert agent.db("primary").execute("SELECT count(*) FROM entries WHERE id = ?", (old,)).fetchone()[0] == 0
    assert (
        agent.db("primary")
        .execute("SELECT to_state FROM crystal_audit WHERE entry_id = ? ORDER BY id DESC", (old,))
        .fetchone()[0]
        == "purged"
    )
    agent.close()


def test_merge_keeps_provenance_sums_accesses_and_skips_minimal_pairs(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    a, b, c, d = agent.add(
        [
            CrystalSpec(
                "Marta runs the bakery at the east gate.", "file", path="MEMORY.md", start_line=1, end_line=1
            ),
            CrystalSpec(
                "Marta runs the bakery at the east gate.",
                "transcript",
                "fact",
                session_id="s1",
                turn_ids=("t4",),
            ),
            CrystalSpec("the cisterns flood every spring", "note"),
            CrystalSpec("the cisterns flood every spring", "note", semantic_type="goal"),  # other type: kept
        ]
    )
    with agent.db("primary") as db:
        db.execute("UPDATE entries SET access_count = 3 WHERE id = ?", (a,))
        db.execute("UPDATE entries SET access_count = 2 WHERE id = ?", (b,))
    report = consolidate(agent)
    assert report["primary"]["merged"] == 1  # type: ignore[index]
    db = agent.db("primary")
    rows = {
        r[0]: r[1:] for r in db.execute("SELECT entry_id, lifecycle, parent_uid, merged_from FROM crystals")
    }
    winner, loser = (a, b) if rows[a][0] == "consolidated" else (b, a)
    uid = dict(db.execute("SELECT id, event_uid FROM entries"))
    assert rows[loser][:2] == ("archived", uid[winner]) and json.loads(rows[winner][2]) == [uid[loser]]
    assert db.execute("SELECT access_count FROM entries WHERE id = ?", (winner,)).fetchone()[0] == 5
    assert rows[c][0] == rows[d][0] == "generated"
    found = agent.memory_search("bakery east gate", min_score=-1, record_access=False)
    assert [h["text"] for h in found].count("Marta runs the bakery at the east gate.") == 1
    assert minimal_pair("Marta runs the bakery at the east gate.", "Marta runs the bakery at the west gate.")
    assert not minimal_pair("The cisterns flood every spring.", "Every spring the cisterns flood.")
    agent.close()


def test_merge_threshold_calibration_on_minilm() -> None:
    """The labelled pairs of tests/helpers/merge_pairs.py: precision of a merge >= 0.95."""
    from nimmer_train.memory.embedding import SentenceEmbedder

    embed = SentenceEmbedder().embed

    def merges(pairs: list[tuple[str, str]]) -> np.ndarray:
        left, right = embed([p[0] for p in pairs]), embed([p[1] for p in pairs])
        cosine = (left * right).sum(axis=1)
        return (cosine >= DEFAULT_POLICY.merge_threshold) & np.array([not minimal_pair(*p) for p in pairs])

    true_pos, false_pos = merges(PARAPHRASES).sum(), merges(RELATED).sum()
    precision, recall = true_pos / (true_pos + false_pos), true_pos / len(PARAPHRASES)
    print(f"merge threshold {DEFAULT_POLICY.merge_threshold}: precision {precision:.3f} recall {recall:.3f}")
    assert precision >= 0.95 and recall >= 0.6


def test_ttl_boundary_and_stalled_goals(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    start = clock.now
    (ttl,) = agent.add([CrystalSpec("the gate is open tonight", "note", lifespan="ttl", ttl_s=3600)])
    (goal,) = agent.add([CrystalSpec("My goal is to reopen the mill", "note")])
    clock.now = start + 3599
    assert consolidate(agent)["primary"]["ttl_expired"] == 0  # type: ignore[index]
    clock.now = start + 3601
    assert consolidate(agent)["primary"]["ttl_expired"] == 1  # type: ignore[index]
    assert agent.memory_status()["goals"][0]["stalled"] is False
    clock.now = start + 7 * DAY + 1
    assert consolidate(agent)["primary"]["stalled_goals"] == 1  # type: ignore[index]
    assert agent.memory_status()["goals"] == [
        {"id": agent.uid("primary", goal), "text": "My goal is to reopen the mill", "stalled": True}
    ]
    agent.close()


def test_frozen_skills_are_untouched_by_a_thousand_days_of_consolidation(tmp_path: Path) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    agent.add([CrystalSpec("Grind the beans, then pour slowly.", "skill", lifespan="permanent")])
    agent.add([CrystalSpec("a passing remark", "note")])
    frozen = "SELECT * FROM crystals c JOIN entries e ON e.id = c.entry_id WHERE c.lifecycle = 'frozen'"
    before = agent.db("primary").execute(frozen).fetchall()
    for _ in range(100):
        clock.now += 10 * DAY
        consolidate(agent)
    assert agent.db("primary").execute(frozen).fetchall() == before
    assert (
        agent.db("primary").execute("SELECT count(*) FROM entries").fetchone()[0] == 1
    )  # the remark: purged
    agent.close()


def test_a_kill_mid_consolidation_leaves_a_consistent_store(tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from nimmer_train.agent.consolidation import consolidate
        from nimmer_train.agent.crystals import CrystalSpec
        from tests.helpers.memory import Clock, agent_memory
        clock = Clock()
        agent = agent_memory(__import__("pathlib").Path({str(tmp_path)!r}), clock)
        texts = [f"remark {{i % 300}} about the lantern market" for i in range(3000)]
        agent.add([CrystalSpec(t, "note") for t in texts])
        print("ready", flush=True)
        while True:
            clock.now += 20 * 86400
            consolidate(agent)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.4)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    agent = agent_memory(tmp_path, Clock(1_900_000_000.0))
    db = agent.db("primary")
    assert integrity_ok(db)
    last_audit = dict(
        db.execute(
            "SELECT entry_id, to_state FROM crystal_audit a "
            "WHERE id = (SELECT max(id) FROM crystal_audit b WHERE b.entry_id = a.entry_id)"
        )
    )
    for entry_id, lifecycle, parent in db.execute("SELECT entry_id, lifecycle, parent_uid FROM crystals"):
        assert last_audit[entry_id] == lifecycle  # every move committed with its audit row
        assert (lifecycle == "archived") == (parent is not None) or lifecycle == "expired"
    vec = db.execute("SELECT count(*) FROM entries_vec").fetchone()[0]
    assert vec == db.execute("SELECT count(*) FROM entries").fetchone()[0]
    first = consolidate(agent)
    before = _snapshot(agent)
    consolidate(agent, first["now"])  # type: ignore[arg-type]
    assert _snapshot(agent) == before
    agent.close()


def test_scheduler_coalesces_missed_runs_and_runs_one_at_a_time(tmp_path: Path, capsys) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    agent.add([CrystalSpec("a remark", "note")])
    scheduler = ConsolidationScheduler(agent, tick_s=3600)
    assert scheduler.tick() is not None  # never consolidated: due
    assert scheduler.tick() is None  # same game time: not due
    clock.now += 5 * DEFAULT_POLICY.interval_s  # five intervals missed -> one run
    assert scheduler.tick() is not None and scheduler.tick() is None
    assert scheduler.runs == 2
    clock.now += DEFAULT_POLICY.interval_s
    with consolidation_lock(tmp_path) as held:  # another process is consolidating this folder
        assert held
        assert run_once(agent) is None and scheduler.tick() is None
        assert cli_main(["memory", "consolidate", str(tmp_path)]) == 3
    assert "running already" in capsys.readouterr().err
    assert scheduler.skipped == 1
    status = agent.memory_status()
    assert status["scheduler"]["max_instances"] == 1 and status["consolidation"]["next"] is not None
    job = scheduler.job
    assert job.coalesce is True and job.max_instances == 1
    agent.close()


def test_the_background_scheduler_fires_and_the_cli_consolidates(tmp_path: Path, capsys) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    agent.add([CrystalSpec("a remark", "note")])
    scheduler = ConsolidationScheduler(agent, tick_s=0.05).start()
    deadline = time.monotonic() + 60  # hang guard only
    while scheduler.runs == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    scheduler.shutdown()
    assert scheduler.runs == 1  # the game clock did not move: one run, however many ticks
    agent.close()
    assert cli_main(["memory", "consolidate", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["primary"]) == {
        "rescored",
        "forgotten",
        "purged",
        "merged",
        "ttl_expired",
        "stalled_goals",
    }
    assert cli_main(["memory", "consolidate", str(tmp_path / "missing")]) == 2


@pytest.mark.parametrize("n", [200])
def test_merge_compares_only_new_arrivals(tmp_path: Path, n: int) -> None:
    clock = Clock()
    agent = agent_memory(tmp_path, clock)
    agent.add(
        [CrystalSpec(f"distinct remark number {i} on topic {i * 7919 % 101}", "note") for i in range(n)]
    )
    assert consolidate(agent)["primary"]["merged"] == 0  # type: ignore[index]
    checked = (
        agent.db("primary").execute("SELECT count(*) FROM crystals WHERE merge_checked = 1").fetchone()[0]
    )
    assert checked == n
    agent.add([CrystalSpec(f"distinct remark number 5 on topic {5 * 7919 % 101}", "note")])  # #5 again
    assert consolidate(agent)["primary"]["merged"] == 1  # type: ignore[index]
    agent.close()
