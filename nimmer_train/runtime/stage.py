"""The end of ``run_all``: load the newest version verified, then speak one turn per register
through Ring A (in-process) and through ``nimmer serve`` (a real server process, Ring B), with the
demo player's memory as the knowledge stack and the spoken lines written back to it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from nimmer_train import tracking
from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config import Config
from nimmer_train.errors import NimmerError
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA, RingB, RingConfig
from nimmer_train.runtime.selection import SelectionConfig
from nimmer_train.runtime.turn import NpcRuntime, Turn, TurnRequest
from nimmer_train.runtime.voice_eval import (
    heldout_of_adapters,
    heldout_of_config,
    recorded_heldout,
    recorded_settings,
    voice_eval,
)
from nimmer_train.voice.prompt_dsl import AffectState
from nimmer_train.voice.quality import VoiceReport

TURNS_FILE = "turns.json"
VOICE_FILE = "voice_report.json"


@contextlib.contextmanager
def serve_process(releases: Path, version: str, trusted: Path, timeout_s: float = 120) -> Iterator[str]:
    """``nimmer serve`` as a subprocess on a free loopback port; yields its /v1 URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "nimmer_train.cli",
        "serve",
        "--releases",
        str(releases),
        "--trusted-keys",
        str(trusted),
        "--version",
        version,
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise NimmerError(
                    f"nimmer serve exited ({proc.returncode}): {proc.stdout.read() if proc.stdout else ''}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/models", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise NimmerError(f"nimmer serve did not answer on {url} within {timeout_s:.0f} s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()


def _request(register: str, traits: dict[str, float], tier: str) -> TurnRequest:
    return TurnRequest(
        npc=f"npc-{register}",
        gesture=traits,
        player_utterance="What news from the gate tonight?",
        turn_intent="answer the player in your own register",
        zone_context="the lower ring at dusk, by the water gate",
        district="lower-ring",
        affect=AffectState("watchful", valence=-0.1, arousal=0.5),
        tier=tier,
    )


AGENT_FACTS = """# What the gate-keeper knows

## The lower ring
The water gate closes at the second bell. Smugglers use the drain under the fish market.

## People
Brother Anselm preaches at the salt steps every evening and distrusts the hivemind wardens.
"""


@contextlib.contextmanager
def agent_transcripts(folder: Path) -> Iterator[Any]:
    """The demo NPC agent's memory (issue 16) and a transcript indexer on it, for the runtime to
    queue its exchanges to; flushed and closed on exit."""
    from nimmer_train.agent.agent_memory import AgentMemory
    from nimmer_train.agent.ingestion import TranscriptIndexer
    from nimmer_train.memory.embedding import SentenceEmbedder

    folder.mkdir(parents=True, exist_ok=True)
    agent = AgentMemory(folder, SentenceEmbedder())
    indexer = TranscriptIndexer(agent)
    try:
        yield indexer
        indexer.flush()
    finally:
        indexer.close()
        agent.close()


def agent_memory_session(folder: Path, turns: list[Turn]) -> dict[str, object]:
    """A short scripted session of an NPC agent with long-term memory (issue 16), after the
    runtime indexed the demo's turns as episodes (:func:`agent_transcripts`): its workspace notes
    are ingested, two directives (the second supersedes the first), a search, one consolidation;
    prints and returns ``memory_status``."""
    from nimmer_train.agent.agent_memory import AgentMemory
    from nimmer_train.agent.consolidation import consolidate
    from nimmer_train.agent.ingestion import ingest_workspace
    from nimmer_train.memory.embedding import SentenceEmbedder

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
    from nimmer_train.agent.agent_memory import AgentMemory
    from nimmer_train.agent.dreams import DreamEngine, show_cycle
    from nimmer_train.memory.embedding import SentenceEmbedder

    agent = AgentMemory(folder, SentenceEmbedder())
    try:
        for note in DUSK_VISITS:
            agent.working_memory_note(note)
        lines = show_cycle(DreamEngine(agent), ["replay", "compression"])
    finally:
        agent.close()
    print("  " + "\n  ".join(lines))
    return lines


@dataclass
class SpeakResult:
    """The turns spoken (one per register and tier) and where they were written; the voice report
    of the loaded version (None when publish.voice_eval is off), written beside them."""

    turns: list[Turn]
    path: Path
    voice: VoiceReport | None = None


def speak_stage(cfg: Config, pipeline: str = "speak") -> SpeakResult:
    """Speak the demo turns inside an MLflow run (turns table and timings logged), then measure
    the version's voice (publish.voice_eval's set of turns, the same as its model card's)."""
    path = Path(cfg.paths.workdir).resolve() / "runtime" / TURNS_FILE
    r = cfg.runtime
    with tracking.stage_run(cfg, pipeline, "speak") as run_id:
        model = LocalModel.open(Path(r.releases_dir), r.version, Path(r.trusted_keys))
        agent = Path(cfg.paths.workdir).resolve() / "agents" / "demo-npc"
        try:
            with agent_transcripts(agent) as transcripts:
                turns = _speak(cfg, model, path, transcripts)
                mood_turns(cfg, model, agent)
            voice = _voice(cfg, model, path.parent / VOICE_FILE, run_id)
        finally:
            model.close()
        status = agent_memory_session(agent, turns)
        agent_dream_session(agent)
        if run_id:
            import mlflow

            mlflow.log_dict(status, "agent_memory_status.json")
        if run_id:
            import mlflow

            rows = [
                {
                    "register": t.register,
                    "ring": t.ring,
                    "adapter": t.adapter or "",
                    "reply": json.dumps(t.reply),
                    "temperature": t.knobs["temperature"],
                    "top_p": t.knobs["top_p"],
                    "seconds": t.seconds,
                }
                for t in turns
            ]
            mlflow.log_table({k: [r[k] for r in rows] for k in rows[0]}, TURNS_FILE)
            mlflow.log_metrics(
                {"turns": len(turns), "mean_turn_seconds": sum(t.seconds for t in turns) / len(turns)}
            )
    return SpeakResult(turns, path, voice)


def mood_turns(cfg: Config, model: LocalModel, folder: Path) -> list[Turn]:
    """Issue 17: the demo agent speaks on Ring A at rest, right after a reward (a game event),
    and eight game hours later, on a game clock of its own; prints each turn with its knobs."""
    from dataclasses import replace

    from nimmer_train.agent.hormones import Hormones

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
            req = replace(_request(register, traits, "casual"), events=events)
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


def _voice(cfg: Config, model: LocalModel, path: Path, run_id: str | None) -> VoiceReport | None:
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
        import mlflow

        mlflow.log_metrics(report.metrics())
        mlflow.log_dict(report.summary(), VOICE_FILE)
    return report


def _speak(cfg: Config, model: LocalModel, path: Path, transcripts: Any = None) -> list[Turn]:
    """One turn per register and tier through the rings; each exchange goes to ``transcripts``
    (a TranscriptIndexer) as the runtime speaks it."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    r = cfg.runtime
    releases, trusted = Path(r.releases_dir), Path(r.trusted_keys)
    registers = [*model.registers, *([model.merged_register] if model.merged_register else [])]
    from nimmer_train.memory.embedding import SentenceEmbedder
    from nimmer_train.memory.sync import open_player

    memory, _ = open_player(Path(r.player_dir), SentenceEmbedder())
    turns: list[Turn] = []
    try:
        with serve_process(releases, model.label, trusted) as url:
            rings = {"casual": RingA(model), "deep": RingB(RingConfig(ring="B", base_url=url))}
            runtime = NpcRuntime(
                cfg.registers,
                rings,
                memory=memory,
                selection=SelectionConfig(r.decay, r.margin, r.patience),
                registers=sorted(registers),
                max_new_tokens=r.max_new_tokens,
                transcripts=transcripts,
                session_id="demo-session",
            )
            for register in sorted(registers):
                traits = cfg.registers.get(register).traits
                for tier in ("casual", "deep"):
                    turn = runtime.speak(_request(register, traits, tier))
                    turns.append(turn)
    finally:
        memory.close()
    write_json_atomic(path, [asdict(t) for t in turns])
    print(f"\nOne turn per register on {model.label} (ring A: in-process; ring B: nimmer serve at {url}):")
    for t in turns:
        k = t.knobs
        lora = t.adapter or "no LoRA: in the weights"
        print(
            f"  [{t.register}] ring {t.ring} ({lora}; "
            f"T={k['temperature']}, top_p={k['top_p']}, top_k={k['top_k']})"
        )
        print(f"      {json.dumps(t.reply, ensure_ascii=False)}")
    print(f"turns (with prompts, knobs and timings): {path}")
    return turns
