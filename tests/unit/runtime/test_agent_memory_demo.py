"""The demo's scripted NPC agent session (speak stage, issue 16): the exchanges the runtime
queued while speaking (:func:`agent_transcripts`) and the workspace notes become crystals, a
newer directive supersedes the older, search finds the fact, and memory_status reports it all."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from nimmer_train.agent.ingestion import Exchange
from nimmer_train.runtime.demo_sessions import agent_memory_session, agent_transcripts


def test_the_demo_agents_session_ends_in_a_truthful_memory_status(tmp_path: Path, capsys) -> None:
    turns = [
        SimpleNamespace(npc="npc-caste-preacher", reply={"utterance": "The gate shuts at the second bell."}),
        SimpleNamespace(npc="npc-drunk-scavenger", reply={"utterance": "Smugglers again, by the drain."}),
    ]
    with agent_transcripts(tmp_path / "npc") as transcripts:  # what NpcRuntime.speak queues
        for i, turn in enumerate(turns):
            said = (("player", "What news?"), (turn.npc, turn.reply["utterance"]))
            transcripts.submit(Exchange("demo-session", (f"t{i}",), said, 1.0e9 + i))
    status = agent_memory_session(tmp_path / "npc", turns)  # type: ignore[arg-type]
    primary = status["stores"]["primary"]
    assert sum(primary["lifecycle"].values()) == 3 + 2 + 2  # three workspace chunks, two exchanges, two notes
    assert primary["superseded"] == 1
    assert status["user_profile"] == ["The player now wants long, detailed answers about the gate."]
    assert status["consolidation"]["last"] is not None and status["searches_logged"] == 1
    out = capsys.readouterr().out
    assert "The water gate closes at the second bell" in out and "Agent memory of demo-npc" in out
