"""Training throughput of build_base's loop against a bare PyTorch loop, in one process.

Both train the same freshly built Llama (model=tiny) on the same packed blocks, batch and
sequence length, with the same optimizer and schedule. Runs alternate (bare, ours, bare, ours,
...) after a warm-up so that machine noise hits both; the ratio of median tokens/s is the result.
Goal: ours / bare >= 0.90.

    python -m benchmarks.bench_build_base [--smoke]      (all of them: make bench)
"""

from __future__ import annotations

import statistics
import time

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


def run(smoke: bool = False) -> dict[str, object]:
    """Median tokens/s of both loops over alternating repeats, and their ratio."""
    steps, repeats, seq_len, batch = (3, 1, 32, 2) if smoke else (30, 3, 256, 8)
    mcfg = ModelConfig(name="tiny")  # the dataclass defaults are conf/model/tiny.yaml
    cfg = TrainConfig(
        seq_len=seq_len,
        micro_batch_size=batch,
        max_steps=steps,
        warmup_steps=min(5, steps - 1),
        eval_every=0,
        checkpoint_every=0,
        log_every=10,
    )
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, mcfg.vocab_size, (64 if smoke else 512, cfg.seq_len), generator=gen)
    warm = 1 if smoke else 6
    measure(bare_loop, mcfg, blocks, TrainConfig(**{**cfg.__dict__, "max_steps": warm, "warmup_steps": 0}))
    results: dict[str, list[float]] = {"bare": [], "build_base": []}
    for _ in range(repeats):
        results["bare"].append(measure(bare_loop, mcfg, blocks, cfg))
        results["build_base"].append(measure(ours, mcfg, blocks, cfg))
    bare, mine = statistics.median(results["bare"]), statistics.median(results["build_base"])
    return {
        "build_base_over_bare_tokens_per_s_ratio": mine / bare,
        "goal": "build_base loop tokens/s >= 0.90 x a bare PyTorch loop (ratio >= 0.90)",
        "model": "tiny",
        "parameters": count_parameters(build_model(mcfg, mcfg.vocab_size, 0, 1, 0)),
        "seq_len": cfg.seq_len,
        "micro_batch_size": cfg.micro_batch_size,
        "steps": cfg.max_steps,
        "repeats": repeats,
        "median_tokens_per_s": {"bare": bare, "build_base": mine},
        "tokens_per_s": results,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
