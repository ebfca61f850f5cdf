"""DP-SGD step time over non-DP step time for LoRA training on the tiny model (Opacus, one
process, same batches): per-sample gradients from hooks, and Opacus ghost clipping.

Goal: DP / non-DP <= 1.5 (only the adapter needs per-sample gradients).
``python -m benchmarks.bench_dp [--smoke]`` (the harness writes benchmarks/results/bench_dp.json).
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from nimmer_train.base.modeling import build_model
from nimmer_train.config import ModelConfig
from nimmer_train.privacy.dp_sgd import DPConfig, lm_loss, lora_changed, lora_snapshot, make_private

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BATCH = 8


def lora_model() -> torch.nn.Module:
    model = build_model(ModelConfig(name="tiny"), 4096, 0, 1, seed=0).to("cpu")  # on its device first
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def median_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    steps: int,
    criterion: object | None = None,
) -> float:
    times = []
    batches = iter(loader)
    for _ in range(steps):
        (x,) = next(batches)
        start = time.perf_counter()
        loss = lm_loss(model, x, x, criterion)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def run(smoke: bool = False) -> dict[str, object]:
    """Median step times of non-DP and DP-SGD (hooks, ghost) LoRA training, same batches."""
    warnings.filterwarnings("ignore")
    steps, seq = (3, 16) if smoke else (14, 128)  # the median of the steps after the first two
    data = TensorDataset(
        torch.randint(0, 4096, (BATCH * steps * 2, seq), generator=torch.Generator().manual_seed(0))
    )
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    base = median_step(model, optimizer, DataLoader(data, batch_size=BATCH), steps)
    figures: dict[str, object] = {"model": "tiny", "batch": BATCH, "seq_len": seq, "lora_rank": 8}
    figures["non_dp_step_s"] = base
    for mode in ("hooks", "ghost"):
        model = lora_model()
        before = lora_snapshot(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        private = make_private(
            model,
            optimizer,
            DataLoader(data, batch_size=BATCH),
            DPConfig(poisson_sampling=False, grad_sample_mode=mode),
        )
        step = median_step(private.model, private.optimizer, private.loader, steps, private.criterion)
        figures[f"dp_{mode}_step_s"] = step
        figures[f"dp_{mode}_over_non_dp_ratio"] = step / base
        figures[f"dp_{mode}_lora_changed"] = lora_changed(private.model, before)
    return {
        "dp_hooks_over_non_dp_ratio": figures.pop("dp_hooks_over_non_dp_ratio"),
        "dp_ghost_over_non_dp_ratio": figures.pop("dp_ghost_over_non_dp_ratio"),
        "goal": "a DP-SGD LoRA step costs at most 1.5 non-DP steps (ratios <= 1.5), and the LoRA "
        "weights change (Opacus + PEFT)",
        **figures,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
