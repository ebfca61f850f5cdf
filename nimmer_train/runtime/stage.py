"""The end of ``run_all``: load the newest version verified, then speak one turn per register
through Ring A (in-process) and through ``nimmer serve`` (a real server process, Ring B), with the
demo player's memory as the knowledge stack and the spoken lines written back to it. This stage
only speaks; the demo's other sessions on the same version (mood, voice report, agent memory,
dreams) are composed around it in :mod:`nimmer_train.runtime.demo_sessions`."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import mlflow

from nimmer_train import tracking
from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config import Config
from nimmer_train.errors import NimmerError
from nimmer_train.memory.embedding import SentenceEmbedder
from nimmer_train.memory.sync import open_player
from nimmer_train.runtime.conversation import Conversations, check_window
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA, RingB, RingConfig
from nimmer_train.runtime.selection import SelectionConfig
from nimmer_train.runtime.turn import NpcRuntime, Turn, TurnRequest
from nimmer_train.voice.prompt_dsl import AffectState
from nimmer_train.voice.quality import VoiceReport

TURNS_FILE = "turns.json"


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


def demo_request(register: str, traits: dict[str, float], tier: str) -> TurnRequest:
    """The demo's turn: the player asks an NPC of ``register`` for the gate's news on ``tier``."""
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


@dataclass
class SpeakResult:
    """The turns spoken (one per register and tier) and where they were written; the voice report
    of the loaded version (None when publish.voice_eval is off or no sessions measured it),
    written beside them."""

    turns: list[Turn]
    path: Path
    voice: VoiceReport | None = None


# what a caller runs on the loaded version inside the stage's run once the turns are spoken
# (model, turns, MLflow run id or None); it returns the version's voice report, or None
Sessions = Callable[[LocalModel, list[Turn], str | None], VoiceReport | None]


def speak_stage(
    cfg: Config, pipeline: str = "speak", transcripts: Any = None, sessions: Sessions | None = None
) -> SpeakResult:
    """Speak the demo turns inside an MLflow run (turns table and timings logged). Each exchange
    goes to ``transcripts`` (an agent's TranscriptIndexer; None: not indexed) as it is spoken;
    ``sessions`` then run on the same loaded version inside the same run (the demo's:
    :func:`nimmer_train.runtime.demo_sessions.speak_demo`), their voice report the result's."""
    path = Path(cfg.paths.workdir).resolve() / "runtime" / TURNS_FILE
    r = cfg.runtime
    with tracking.stage_run(cfg, pipeline, "speak") as run_id:
        model = LocalModel.open(Path(r.releases_dir), r.version, Path(r.trusted_keys))
        try:
            turns = _speak(cfg, model, path, transcripts)
            voice = sessions(model, turns, run_id) if sessions else None
        finally:
            model.close()
        if run_id:
            _log_turns(turns)
    return SpeakResult(turns, path, voice)


def _log_turns(turns: list[Turn]) -> None:
    """The turns as an MLflow table, with their count and mean seconds, in the active run."""
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
    mlflow.log_metrics({"turns": len(turns), "mean_turn_seconds": sum(t.seconds for t in turns) / len(turns)})


def _speak(cfg: Config, model: LocalModel, path: Path, transcripts: Any = None) -> list[Turn]:
    """One turn per register and tier through the rings; each exchange goes to ``transcripts``
    (a TranscriptIndexer) as the runtime speaks it."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    r = cfg.runtime
    releases, trusted = Path(r.releases_dir), Path(r.trusted_keys)
    registers = [*model.registers, *([model.merged_register] if model.merged_register else [])]
    # a window that cannot fit beside the reply is refused before the server starts
    check_window(r.conversation_tokens, r.max_new_tokens, {"casual": RingA(model)})
    memory, _ = open_player(Path(r.player_dir), SentenceEmbedder())
    conversations = Conversations(Path(r.player_dir))  # the NPCs remember earlier turns (issue 40)
    turns: list[Turn] = []
    try:
        with serve_process(releases, model.label, trusted) as url:
            ring_a = (  # runtime.engine=llama: the version's GGUF on llama.cpp (issue 39)
                RingA(model)
                if r.engine == "torch"
                else RingA.open(
                    releases,
                    model.label,
                    trusted,
                    True,
                    r.engine,
                    r.quant,
                    r.engine_fallback,
                    threads=r.engine_threads or None,
                )
            )
            # nimmer serve serves this version: Ring B's prompt fits the same context, counted by
            # the same tokenizer (its default word estimate let a window overflow the tiny model's)
            ring_b = RingB(RingConfig(ring="B", base_url=url, context_tokens=model.context_tokens))
            ring_b.count = RingA(model).count
            rings = {"casual": ring_a, "deep": ring_b}
            runtime = NpcRuntime(
                cfg.registers,
                rings,
                memory=memory,
                selection=SelectionConfig(r.decay, r.margin, r.patience),
                registers=sorted(registers),
                max_new_tokens=r.max_new_tokens,
                transcripts=transcripts,
                session_id="demo-session",
                conversations=conversations,
                conversation_tokens=r.conversation_tokens,
                query_lines=r.query_lines,
                min_relevance=r.memory_min_relevance,
            )
            for register in sorted(registers):
                traits = cfg.registers.get(register).traits
                for tier in ("casual", "deep"):
                    turn = runtime.speak(demo_request(register, traits, tier))
                    turns.append(turn)
            if ring_a.model is not model:
                ring_a.model.close()
    finally:
        conversations.close()
        memory.close()
    write_json_atomic(path, [asdict(t) for t in turns])
    print(f"\nOne turn per register on {model.label} (ring A: in-process; ring B: nimmer serve at {url}):")
    for t in turns:
        k = t.knobs
        lora = t.adapter or "no LoRA: in the weights"
        print(
            f"  [{t.register}] ring {t.ring} ({lora}; "
            f"T={k['temperature']}, top_p={k['top_p']}, top_k={k['top_k']}; "
            f"{t.window_lines} earlier lines in the prompt)"
        )
        print(f"      {json.dumps(t.reply, ensure_ascii=False)}")
    print(f"turns (with prompts, knobs and timings): {path}")
    return turns
