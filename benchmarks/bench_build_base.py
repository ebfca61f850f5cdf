"""Training throughput of build_base's loop against a bare PyTorch loop, in one process.

Both train the same freshly built Llama (model=tiny) on the same packed blocks, batch and
sequence length, with the same optimizer and schedule. Runs alternate (bare, ours, bare, ours,
...) after a warm-up so that machine noise hits both; the ratio of median tokens/s is the result.
Goal: ours / bare >= 0.90. Writes benchmarks/results/bench_build_base.json.

    make bench            (or: python -m benchmarks.bench_build_base --steps 30 --repeats 3)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from accelerate import Accelerator

from nimmer_train.base.modeling import build_model, count_parameters
from nimmer_train.base.pretrain import batch_indices, make_optimizer, make_scheduler, train
from nimmer_train.config import ModelConfig, TrainConfig


def bare_loop(model: torch.nn.Module, blocks: torch.Tensor, cfg: TrainConfig) -> None:
    """The plainest correct loop: forward, backward, clip, step."""
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    model.train()
    for step in range(cfg.max_steps):
        x = blocks[batch_indices(step, 0, cfg, 0, 1, len(blocks))]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def ours(model: torch.nn.Module, blocks: torch.Tensor, cfg: TrainConfig) -> None:
    train(model, blocks, None, cfg, Accelerator(cpu=True))


def measure(fn, mcfg: ModelConfig, blocks: torch.Tensor, cfg: TrainConfig) -> float:
    model = build_model(mcfg, mcfg.vocab_size, 0, 1, seed=cfg.seed)
    start = time.perf_counter()
    fn(model, blocks, cfg)
    elapsed = time.perf_counter() - start
    return cfg.max_steps * cfg.micro_batch_size * cfg.seq_len / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()

    mcfg = ModelConfig(name="tiny")  # the dataclass defaults are conf/model/tiny.yaml
    cfg = TrainConfig(
        seq_len=args.seq_len,
        micro_batch_size=args.batch,
        max_steps=args.steps,
        warmup_steps=min(5, args.steps - 1),
        eval_every=0,
        checkpoint_every=0,
        log_every=10,
    )
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, mcfg.vocab_size, (512, cfg.seq_len), generator=gen)
    measure(bare_loop, mcfg, blocks, TrainConfig(**{**cfg.__dict__, "max_steps": 6, "warmup_steps": 1}))
    results: dict[str, list[float]] = {"bare": [], "build_base": []}
    for _ in range(args.repeats):
        results["bare"].append(measure(bare_loop, mcfg, blocks, cfg))
        results["build_base"].append(measure(ours, mcfg, blocks, cfg))
    bare, mine = statistics.median(results["bare"]), statistics.median(results["build_base"])
    report = {
        "model": "tiny",
        "parameters": count_parameters(build_model(mcfg, mcfg.vocab_size, 0, 1, 0)),
        "seq_len": cfg.seq_len,
        "micro_batch_size": cfg.micro_batch_size,
        "steps": cfg.max_steps,
        "torch_threads": torch.get_num_threads(),
        "tokens_per_s": results,
        "median_tokens_per_s": {"bare": bare, "build_base": mine},
        "ratio": mine / bare,
        "goal": 0.90,
    }
    out = Path(__file__).parent / "results" / "bench_build_base.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    for name, label in (("bare", "bare PyTorch loop"), ("build_base", "build_base loop")):
        runs = ", ".join(f"{v:.0f}" for v in results[name])
        print(f"{label:20s}{statistics.median(results[name]):10.0f} tokens/s  (runs: {runs})")
    print(f"ratio build_base / bare = {mine / bare:.3f}  (goal >= 0.90)  -> {out}")


if __name__ == "__main__":
    main()
