"""DP-SGD step time over non-DP step time for LoRA training on the tiny model (Opacus, one
process, same batches): per-sample gradients from hooks, and Opacus ghost clipping.

Goal: DP / non-DP <= 1.5 (only the adapter needs per-sample gradients).
Writes benchmarks/results/bench_dp.json.  python -m benchmarks.bench_dp
"""

from __future__ import annotations

import json
import statistics
import time
import warnings
from pathlib import Path

import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from nimmer_train.base.modeling import build_model
from nimmer_train.config import ModelConfig
from nimmer_train.privacy.dp_sgd import DPConfig, lm_loss, lora_changed, lora_snapshot, make_private

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS, BATCH, SEQ = 14, 8, 128


def lora_model() -> torch.nn.Module:
    model = build_model(ModelConfig(name="tiny"), 4096, 0, 1, seed=0).to("cpu")  # on its device first
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def median_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    criterion: object | None = None,
) -> float:
    times = []
    batches = iter(loader)
    for _ in range(STEPS):
        (x,) = next(batches)
        start = time.perf_counter()
        loss = lm_loss(model, x, x, criterion)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


def main() -> None:
    warnings.filterwarnings("ignore")
    data = TensorDataset(
        torch.randint(0, 4096, (BATCH * STEPS * 2, SEQ), generator=torch.Generator().manual_seed(0))
    )
    report: dict[str, object] = {"model": "tiny", "batch": BATCH, "seq_len": SEQ, "lora_rank": 8}
    model = lora_model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    base = median_step(model, optimizer, DataLoader(data, batch_size=BATCH))
    report["non_dp_step_s"] = base
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
        step = median_step(private.model, private.optimizer, private.loader, private.criterion)
        report[f"dp_{mode}_step_s"] = step
        report[f"dp_{mode}_over_non_dp"] = step / base
        report[f"dp_{mode}_lora_changed"] = lora_changed(private.model, before)
    out = Path(__file__).parent / "results" / "bench_dp.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"non-DP LoRA step {base * 1000:.0f} ms")
    for mode in ("hooks", "ghost"):
        print(
            f"DP-SGD ({mode}) step {report[f'dp_{mode}_step_s'] * 1000:.0f} ms, "
            f"ratio {report[f'dp_{mode}_over_non_dp']:.2f} (goal <= 1.5), "
            f"LoRA weights changed: {report[f'dp_{mode}_lora_changed']}"
        )
    print(f"-> {out}")


if __name__ == "__main__":
    main()
