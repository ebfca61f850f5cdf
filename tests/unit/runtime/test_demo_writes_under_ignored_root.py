"""`make demo` leaves nothing untracked in the repository: the demo NPC agent's sessions (mood
turns, transcripts, memory session, dream) write only under ``runtime.agent_dir``, which lies
under the workdir's ``runtime/`` (git-ignored), whatever the current directory is."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from nimmer_train.agent.ingestion import Exchange
from nimmer_train.runtime.demo_sessions import (
    agent_dream_session,
    agent_memory_session,
    agent_transcripts,
    mood_turns,
)
from nimmer_train.runtime.local_model import LocalModel
from tests.helpers import REPO
from tests.helpers.compose import config


def test_the_demo_agent_writes_only_under_its_configured_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, model: LocalModel
) -> None:
    cwd, workdir = tmp_path / "cwd", tmp_path / "work"
    cwd.mkdir()
    monkeypatch.chdir(cwd)  # nothing may land in the current directory (the repository, in make demo)
    cfg = config(f"paths.workdir={workdir}", "runtime.max_new_tokens=24")
    folder = Path(cfg.runtime.agent_dir)
    assert folder == workdir / "runtime" / "agents" / "demo-npc"

    with agent_transcripts(folder) as transcripts:  # as speak_demo runs them
        turns = mood_turns(cfg, model, folder)
        for i, turn in enumerate(turns):
            said = (("player", "What news?"), (turn.npc, str(turn.reply.get("utterance", ""))))
            transcripts.submit(Exchange("demo-session", (f"t{i}",), said, 1.0e9 + i))
    agent_memory_session(folder, turns)
    agent_dream_session(folder)

    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and all(p.is_relative_to(folder) for p in written), [
        str(p) for p in written if not p.is_relative_to(folder)
    ]
    names = {p.relative_to(folder).as_posix() for p in written}
    assert {"MEMORY.md", "hormones.sqlite"} <= names


def test_the_default_agent_folder_is_ignored_by_git() -> None:
    folder = Path(config().runtime.agent_dir)  # paths.workdir defaults to the repository
    assert folder.is_relative_to(REPO)
    for name in ("MEMORY.md", "hormones.sqlite", "memory/scratch.md"):
        path = (folder / name).relative_to(REPO)
        ignored = subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO, check=False)
        assert ignored.returncode == 0, f"{path} would be untracked in the repository"
