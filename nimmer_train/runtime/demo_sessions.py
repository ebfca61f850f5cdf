"""The demo's sessions on the version the speak stage loads, and :func:`speak_demo`, which
composes them around :func:`~nimmer_train.runtime.stage.speak_stage` (what ``run_all`` and
``pipelines.speak`` run): the demo NPC agent indexes the spoken exchanges (issue 16), its mood
reaches the voice on Ring A (issue 17), the version's voice report is measured, and the agent
runs a short memory session and dreams once (issues 16 and 17). Printed in that order, logged to
the speak stage's MLflow run."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import mlflow

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.consolidation import consolidate
from nimmer_train.agent.dreams import DreamEngine, show_cycle
from nimmer_train.agent.hormones import Hormones
from nimmer_train.agent.ingestion import TranscriptIndexer, ingest_workspace
from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config import Config
from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA
from nimmer_train.runtime.stage import SpeakResult, demo_request, speak_stage
from nimmer_train.runtime.turn import NpcRuntime, Turn
from nimmer_train.runtime.voice_eval import (
    heldout_of_adapters,
    heldout_of_config,
    recorded_heldout,
    recorded_settings,
    voice_eval,
)
from nimmer_train.voice.quality import VoiceReport

VOICE_FILE = "voice_report.json"


def speak_demo(cfg: Config, pipeline: str = "speak") -> SpeakResult:
    """The speak stage with the demo's sessions: the demo agent indexes the spoken turns'
    exchanges; then, on the same loaded version and in the stage's MLflow run, the mood turns,
    the voice report (``runtime/voice_report.json``), the agent's memory session (its
    ``memory_status`` logged) and one dream."""
    workdir = Path(cfg.paths.workdir).resolve()
    agent = Path(cfg.runtime.agent_dir).resolve()
    with contextlib.ExitStack() as indexing:
        transcripts = indexing.enter_context(agent_transcripts(agent))

        def sessions(model: LocalModel, turns: list[Turn], run_id: str | None) -> VoiceReport | None:
            mood_turns(cfg, model, agent)
            indexing.close()  # the spoken exchanges indexed and the agent closed before it is reopened
            voice = voice_session(cfg, model, workdir / "runtime" / VOICE_FILE, run_id)
            status = agent_memory_session(agent, turns)
            agent_dream_session(agent)
            if run_id:
                mlflow.log_dict(status, "agent_memory_status.json")
            return voice

        return speak_stage(cfg, pipeline, transcripts, sessions)


@contextlib.contextmanager
def agent_transcripts(folder: Path) -> Iterator[TranscriptIndexer]:
    """The demo NPC agent's memory (issue 16) and a transcript indexer on it, for the runtime to
    queue its exchanges to; flushed and closed on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    agent = AgentMemory(folder, SentenceEmbedder())
    indexer = TranscriptIndexer(agent)
    try:
        yield indexer
        indexer.flush()
    finally:
        indexer.close()
        agent.close()


def mood_turns(cfg: Config, model: LocalModel, folder: Path) -> list[Turn]:
    """Issue 17: the demo agent speaks on Ring A at rest, right after a reward (a game event),
    and eight game hours later, on a game clock of its own; prints each turn with its knobs."""
    game = {"now": time.time() - 9 * 3600.0}  # so the day ends before now: the agent is at rest again
    hormones = Hormones(folder, lambda: game["now"])
    register = sorted(model.registers)[0]
    traits = cfg.registers.get(register).traits
    runtime = NpcRuntime(
        cfg.registers,
        {"casual": RingA(model)},
        registers=[register],
        max_new_tokens=cfg.runtime.max_new_tokens,
        hormones={f"npc-{register}": hormones},
    )
    turns, lines = [], []
    try:
        for label, advance, events in (
            ("at rest", 0.0, ()),
            ("after a reward", 60.0, ("reward",)),
            ("8 game hours later", 8 * 3600.0, ()),
        ):
            game["now"] += advance
            req = replace(demo_request(register, traits, "casual"), events=events)
            turn = runtime.speak(req)
            energy = hormones.state()["tone"]["energy"]  # type: ignore[index]
            k = turn.knobs
            lines.append(
                f"  {label:<19} energy {energy:.3f}  T={k['temperature']}, top_p={k['top_p']}, "
                f"repetition_penalty={k['repetition_penalty']}: {json.dumps(turn.reply, ensure_ascii=False)}"
            )
            turns.append(turn)
    finally:
        hormones.close()
    print(f"\nMood reaches the voice ([{register}], ring A):\n" + "\n".join(lines))
    return turns


def voice_session(cfg: Config, model: LocalModel, path: Path, run_id: str | None) -> VoiceReport | None:
    """The version's voice report, printed, written to ``path`` and logged (``voice.vN.*``
    metrics, ``voice_report.json``); measured as its manifest's report was (turns, tokens, seed,
    held-out scenes) when it has one, else on the scenes its LoRAs were not trained on. A report
    left at ``path`` by an earlier run is removed first (none stays when this one is off or fails)."""
    path.unlink(missing_ok=True)
    if not cfg.publish.voice_eval.enabled:
        return None
    manifest = model.version.manifest
    heldout = (
        recorded_heldout(manifest)
        or heldout_of_adapters(list(model.version.loras.values()), cfg.paths.artifacts_dir())
        or heldout_of_config(cfg.composition, cfg.curation.validation_fraction)
    )
    report = voice_eval(
        model,
        recorded_settings(cfg.publish.voice_eval, manifest),
        cfg.registers,
        cfg.composition,
        heldout,
        manifest.get("register_evaluation"),
    )
    write_json_atomic(path, report.summary())
    print("\n" + "\n".join(report.lines()) + f"\nvoice report: {path}")
    if run_id:
        mlflow.log_metrics(report.metrics())
        mlflow.log_dict(report.summary(), VOICE_FILE)
    return report


AGENT_FACTS = """# What the gate-keeper knows

## The lower ring
The water gate closes at the second bell. Smugglers use the drain under the fish market.

## People
Brother Anselm preaches at the salt steps every evening and distrusts the hivemind wardens.
"""


def agent_memory_session(folder: Path, turns: list[Turn]) -> dict[str, object]:
    """A short scripted session of an NPC agent with long-term memory (issue 16), after the
    runtime indexed the demo's turns as episodes (:func:`agent_transcripts`): its workspace notes
    are ingested, two directives (the second supersedes the first), a search, one consolidation;
    prints and returns ``memory_status``."""
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "MEMORY.md").exists():
        (folder / "MEMORY.md").write_text(AGENT_FACTS)
    agent = AgentMemory(folder, SentenceEmbedder())
    try:
        ingested = ingest_workspace(agent)
        agent.working_memory_note("The player wants short answers.", kind="directive")
        agent.working_memory_note(
            "The player now wants long, detailed answers about the gate.", kind="directive"
        )
        hits = agent.memory_search("when does the water gate close?", max_results=3)
        report = consolidate(agent)
        status = agent.memory_status()
    finally:
        agent.close()
    lifecycle = status["stores"]["primary"]["lifecycle"]  # type: ignore[index]
    print(f"\nAgent memory of demo-npc ({folder}): workspace {ingested}, {len(turns)} exchanges indexed")
    print(f"  memory_search('when does the water gate close?') -> {hits[0]['text'][:90]!r}" if hits else "")
    print(f"  lifecycle {lifecycle}; superseded {status['stores']['primary']['superseded']}")  # type: ignore[index]
    print(f"  user profile (live directives): {status['user_profile']}")
    print(f"  consolidation: {report.get('primary')} in {report.get('wall_s')} s")
    return status


DUSK_VISITS = (
    "The player came to the water gate at dusk to watch the boats.",
    "At dusk the player came to the water gate again to watch the boats.",
    "The player came back to the water gate at dusk, watching the boats.",
)


def agent_dream_session(folder: Path) -> list[str]:
    """The demo agent notes a habit (three visits at dusk), then dreams once (replay and
    compression, no LLM): prints and returns the cycle's insights (issue 17)."""
    agent = AgentMemory(folder, SentenceEmbedder())
    try:
        for note in DUSK_VISITS:
            agent.working_memory_note(note)
        lines = show_cycle(DreamEngine(agent), ["replay", "compression"])
    finally:
        agent.close()
    print("  " + "\n  ".join(lines))
    return lines
