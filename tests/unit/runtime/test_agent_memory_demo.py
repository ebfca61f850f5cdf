"""The demo's scripted NPC agent session (speak stage, issue 16): workspace notes and the
session's exchanges become crystals, a newer directive supersedes the older, search finds the
fact, and memory_status reports it all."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from nimmer_train.runtime.stage import agent_memory_session


def test_the_demo_agents_session_ends_in_a_truthful_memory_status(tmp_path: Path, capsys) -> None:
    turns = [
        SimpleNamespace(npc="npc-caste-preacher", reply={"utterance": "The gate shuts at the second bell."}),
        SimpleNamespace(npc="npc-drunk-scavenger", reply={"utterance": "Smugglers again, by the drain."}),
    ]
    status = agent_memory_session(tmp_path / "npc", turns)  # type: ignore[arg-type]
    primary = status["stores"]["primary"]
    assert sum(primary["lifecycle"].values()) == 3 + 2 + 2  # three workspace chunks, two exchanges, two notes
    assert primary["superseded"] == 1
    assert status["user_profile"] == ["The player now wants long, detailed answers about the gate."]
    assert status["consolidation"]["last"] is not None and status["searches_logged"] == 1
    out = capsys.readouterr().out
    assert "The water gate closes at the second bell" in out and "Agent memory of demo-npc" in out
