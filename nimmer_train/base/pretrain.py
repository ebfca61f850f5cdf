"""Causal-LM training on packed blocks: the loop build_base runs, nanoGPT-style.

Data order is a pure function of (seed, step, rank), so resuming needs only the step number:
the loop saves model, optimizer, scheduler and RNG state with ``Accelerator.save_state`` every
``checkpoint_every`` steps and a killed run continues from its latest checkpoint to the same
final loss. The same code runs as one process or as N (DDP/FSDP under torchrun or accelerate).
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch.optim.lr_scheduler import LambdaLR

from nimmer_train.config import TrainConfig

MetricLogger = Callable[[dict[str, float], int], None]
TRAIN_STATE = "train_state.json"  # a step-NNNNNN checkpoint's TrainState; its presence marks one complete


def pack_blocks(token_ids: Sequence[Sequence[int]], eos_id: int, seq_len: int) -> torch.Tensor:
    """Concatenate documents, each followed by ``eos_id``, and cut into (N, seq_len) blocks.

    The tail shorter than one block is dropped.
    """
    flat = np.fromiter((t for ids in token_ids for t in (*ids, eos_id)), dtype=np.int64)
    n = len(flat) // seq_len
    return torch.from_numpy(flat[: n * seq_len].reshape(n, seq_len).copy())


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup to 1, then cosine decay to ``min_ratio`` at ``total`` steps."""
    if step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def batch_indices(step: int, micro: int, cfg: TrainConfig, rank: int, world: int, n: int) -> np.ndarray:
    """Block indices for one micro-batch: a fresh permutation of the n blocks each epoch."""
    per_step = cfg.micro_batch_size * world * cfg.grad_accum_steps
    first = step * per_step + (micro * world + rank) * cfg.micro_batch_size
    positions = np.arange(first, first + cfg.micro_batch_size)
    epochs, offsets = np.divmod(positions, n)
    perms = {e: np.random.default_rng([cfg.seed, int(e)]).permutation(n) for e in set(epochs.tolist())}
    return np.array([perms[e][o] for e, o in zip(epochs.tolist(), offsets.tolist(), strict=True)])


@dataclass
class TrainState:
    step: int = 0
    tokens: int = 0
    history: list[dict[str, float]] = field(default_factory=list)  # eval results by step


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on norms or biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))


def make_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig) -> LambdaLR:
    return LambdaLR(optimizer, lambda s: lr_factor(s, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio))


def validation_indices(n: int, cfg: TrainConfig) -> np.ndarray:
    """The validation blocks scored: every one of the ``n``, or with ``cfg.eval_batches`` a
    stratified sample of ``eval_batches * micro_batch_size`` blocks evenly spaced over them (the
    blocks run work by work, so each work keeps its share). It never depends on the processes."""
    if cfg.eval_batches is None or cfg.eval_batches * cfg.micro_batch_size >= n:
        return np.arange(n)
    k = cfg.eval_batches * cfg.micro_batch_size
    return ((np.arange(k) + 0.5) * n / k).astype(np.int64)


def validation_totals(
    model: torch.nn.Module, blocks: torch.Tensor, cfg: TrainConfig, rank: int, world: int, device: Any
) -> torch.Tensor:
    """(summed token loss, tokens) of this process's share of the scored validation blocks.

    Micro-batch b of the scored blocks goes to process b % world, so the batches are the same for
    any number of processes; every process runs the same number of forward passes (a process with
    no batch left scores a block with weight 0), as DDP and FSDP need."""
    scored = blocks[torch.from_numpy(validation_indices(len(blocks), cfg))]
    micro = cfg.micro_batch_size
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for step in range(math.ceil(len(scored) / (micro * world))):
        first = (step * world + rank) * micro
        x = scored[first : first + micro]
        weight = len(x) * (scored.shape[1] - 1)  # predicted tokens: all but each block's first
        x = (x if len(x) else scored[:1]).to(device)
        loss = model(input_ids=x, labels=x).loss.double()
        total += torch.stack([loss * weight, torch.tensor(float(weight), dtype=torch.float64, device=device)])
    return total


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, blocks: torch.Tensor, cfg: TrainConfig, accelerator: Accelerator
) -> float:
    """Mean token loss over every validation block (or the stratified sample ``eval_batches``
    asks for), the same figure for 1 or N processes."""
    model.eval()
    total = validation_totals(
        model, blocks, cfg, accelerator.process_index, accelerator.num_processes, accelerator.device
    )
    total = accelerator.reduce(total, reduction="sum")
    model.train()
    return (total[0] / total[1].clamp(min=1)).item()


def latest_checkpoint(folder: Path) -> Path | None:
    done = sorted(p for p in folder.glob("step-*") if (p / TRAIN_STATE).exists())
    return done[-1] if done else None


def save_checkpoint(accelerator: Accelerator, folder: Path, state: TrainState, keep: int) -> None:
    """Save all training state to ``step-NNNNNN``; it becomes visible only once complete."""
    final = folder / f"step-{state.step:06d}"
    tmp = folder / f".step-{state.step:06d}.tmp"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp), safe_serialization=True)
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAIN_STATE).write_text(json.dumps(state.__dict__))
        tmp.rename(final)
        for old in sorted(p for p in folder.glob("step-*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()


def train(
    model: torch.nn.Module,
    train_blocks: torch.Tensor,
    val_blocks: torch.Tensor | None,
    cfg: TrainConfig,
    accelerator: Accelerator,
    checkpoints: Path | None = None,
    log: MetricLogger = lambda metrics, step: None,
    extra_val: dict[str, torch.Tensor] | None = None,
) -> TrainState:
    """Train ``model`` for ``cfg.max_steps`` optimizer steps, resuming from ``checkpoints``.

    ``extra_val`` names more validation sets (e.g. the synthetic dialogue's held-out scenes),
    scored before training and at the end as ``val_loss_<name>`` / ``val_ppl_<name>``."""
    extra = {name: blocks for name, blocks in (extra_val or {}).items() if len(blocks)}
    optimizer = make_optimizer(model, cfg)
    scheduler = make_scheduler(optimizer, cfg)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)
    state = TrainState()
    resume = latest_checkpoint(checkpoints) if checkpoints else None
    if resume:
        accelerator.load_state(str(resume))
        state = TrainState(**json.loads((resume / TRAIN_STATE).read_text()))
        accelerator.print(f"resumed from {resume} at step {state.step}")
    else:
        if val_blocks is not None and len(val_blocks):
            val = evaluate(model, val_blocks, cfg, accelerator)
            state.history.append({"step": 0, "val_loss": val, "val_ppl": math.exp(val)})
            log({"val_loss": val, "val_ppl": math.exp(val)}, 0)
        _score_extra(model, extra, cfg, accelerator, state, log)

    world, rank, n = accelerator.num_processes, accelerator.process_index, len(train_blocks)
    tokens_per_step = cfg.micro_batch_size * cfg.seq_len * world * cfg.grad_accum_steps
    model.train()
    window_loss, window_steps = torch.zeros((), device=accelerator.device), 0
    window_start = time.perf_counter()
    while state.step < cfg.max_steps:
        for micro in range(cfg.grad_accum_steps):
            x = train_blocks[batch_indices(state.step, micro, cfg, rank, world, n)].to(accelerator.device)
            sync = micro == cfg.grad_accum_steps - 1
            with contextlib.nullcontext() if sync else accelerator.no_sync(model):
                loss = model(input_ids=x, labels=x).loss / cfg.grad_accum_steps
                accelerator.backward(loss)
            window_loss += loss.detach()
        window_steps += 1
        if cfg.grad_clip > 0:
            accelerator.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.tokens += tokens_per_step

        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            train_loss = accelerator.reduce(window_loss, reduction="mean").item() / window_steps
            elapsed = time.perf_counter() - window_start
            log(
                {
                    "train_loss": train_loss,
                    "lr": scheduler.get_last_lr()[0],
                    "tokens_per_s": window_steps * tokens_per_step / elapsed,
                    "tokens": state.tokens,
                },
                state.step,
            )
            state.history.append({"step": state.step, "train_loss": train_loss})
            window_loss.zero_()
            window_steps = 0
            window_start = time.perf_counter()
        is_eval = cfg.eval_every and state.step % cfg.eval_every == 0
        if val_blocks is not None and len(val_blocks) and (is_eval or state.step == cfg.max_steps):
            val = evaluate(model, val_blocks, cfg, accelerator)
            state.history.append({"step": state.step, "val_loss": val, "val_ppl": math.exp(val)})
            log({"val_loss": val, "val_ppl": math.exp(val)}, state.step)
        if state.step == cfg.max_steps:
            _score_extra(model, extra, cfg, accelerator, state, log)
        at_checkpoint = cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0
        if checkpoints and (at_checkpoint or state.step == cfg.max_steps):
            save_checkpoint(accelerator, checkpoints, state, cfg.keep_checkpoints)
    return state


def _score_extra(
    model: torch.nn.Module,
    extra: dict[str, torch.Tensor],
    cfg: TrainConfig,
    accelerator: Accelerator,
    state: TrainState,
    log: MetricLogger,
) -> None:
    for name, blocks in extra.items():
        val = evaluate(model, blocks, cfg, accelerator)
        figures = {f"val_loss_{name}": val, f"val_ppl_{name}": math.exp(val)}
        state.history.append({"step": state.step, **figures})
        log(figures, state.step)
