"""Register LoRA costs, measured side by side in one process on the tiny base (model=tiny):

- seconds per optimizer step of LoRA SFT against a full fine-tune step (same data, batch,
  TRL SFTTrainer, assistant-only loss), and their ratio;
- adapter bytes against base bytes (safetensors on disk);
- set_adapter switch latency (median and p99) with all v1 register adapters loaded.

python -m benchmarks.bench_loras [--smoke]      (all of them: make bench)
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from peft import LoraConfig, get_peft_model
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback
from trl import SFTConfig, SFTTrainer

from nimmer_train.base.modeling import build_model
from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.config import ModelConfig
from nimmer_train.voice.composition import expand
from nimmer_train.voice.prompt_dsl import render_compact
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.compose import composition

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
REPO = Path(__file__).resolve().parents[1]


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, *args: object, **kw: object) -> None:
        self.start = time.perf_counter()

    def on_step_end(self, *args: object, **kw: object) -> None:
        self.times.append(time.perf_counter() - self.start)


def conversations(limit: int | None = None) -> list[list[dict[str, str]]]:
    """The seed set's conversations in the r1 training format; ``limit``: the first ``limit`` of
    them, expanding only the registers they come from (the set is expanded register by register)."""
    replay = {}
    for line in (REPO / "data/seed/teacher_replay_v1.jsonl").read_text().splitlines():
        row = json.loads(line)
        replay[row["key"]] = row["response"]["content"]
    spec, catalogue = composition(), load_catalogue()
    if limit is None:
        requests = expand(spec, catalogue)
    else:  # the same seeds per register index: a prefix of the whole set
        names = list(spec.registers if spec.registers is not None else catalogue.names)
        requests, count = [], 0
        while len(requests) < limit and count < len(names):
            count += 1
            requests = expand(dataclasses.replace(spec, registers=names[:count]), catalogue)
    out = []
    for request in requests[:limit]:
        out.append([*render_compact(request.prompt), {"role": "assistant", "content": replay[request.key]}])
    return out


def step_seconds(
    model: torch.nn.Module,
    tokenizer: object,
    data: Dataset,
    steps: int,
    tmp: str,
    lora: LoraConfig | None,
    batch: int = 8,
    max_length: int = 512,
) -> float:
    args = SFTConfig(
        output_dir=tmp,
        max_steps=steps,
        per_device_train_batch_size=batch,
        learning_rate=1e-3,
        assistant_only_loss=True,
        max_length=max_length,
        bf16=False,
        gradient_checkpointing=False,
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        save_strategy="no",
        logging_steps=1000,
        dataloader_num_workers=0,
        seed=0,
    )
    timer = StepTimer()
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
        callbacks=[timer],
    )
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return statistics.median(timer.times[2:])  # the first steps warm caches up


def run(smoke: bool = False) -> dict[str, object]:
    """Step seconds of LoRA and full fine-tuning, adapter and base bytes, set_adapter latency."""
    steps, examples, switches = (3, 6, 150) if smoke else (12, 160, 2000)  # 3: one step timed
    batch, max_length = (2, 512) if smoke else (8, 512)
    catalogue = load_catalogue()
    convs = conversations(examples if smoke else None)  # smoke: its tokenizer learns only these
    texts = [m["content"] for c in convs for m in c]
    tokenizer = train_bpe(texts, vocab_size=4096, model_max_length=512)
    mcfg = ModelConfig(name="tiny")  # the dataclass defaults are conf/model/tiny.yaml
    data = Dataset.from_dict({"messages": convs[:examples]})
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=TARGETS, task_type="CAUSAL_LM")

    def fresh() -> torch.nn.Module:
        return build_model(mcfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)

    with tempfile.TemporaryDirectory() as tmp:
        full = step_seconds(fresh(), tokenizer, data, steps, f"{tmp}/full", None, batch, max_length)
        lora_s = step_seconds(fresh(), tokenizer, data, steps, f"{tmp}/lora", lora, batch, max_length)

        base = fresh()
        base.save_pretrained(f"{tmp}/base")
        peft_model = get_peft_model(fresh(), lora, adapter_name=catalogue.names[0])
        for name in catalogue.names[1:]:
            peft_model.add_adapter(name, lora)
        peft_model.save_pretrained(f"{tmp}/adapters", selected_adapters=[catalogue.names[0]])
        adapter_bytes = sum(p.stat().st_size for p in Path(f"{tmp}/adapters").rglob("*.safetensors"))
        base_bytes = sum(p.stat().st_size for p in Path(f"{tmp}/base").glob("*.safetensors"))

    peft_model.eval()
    latencies = []
    names = catalogue.names
    for i in range(switches):
        start = time.perf_counter()
        peft_model.set_adapter(names[i % len(names)])
        latencies.append(time.perf_counter() - start)
    latencies_us = np.array(latencies[100:]) * 1e6
    return {
        "lora_over_full_step_ratio": lora_s / full,
        "adapter_over_base_bytes_ratio": adapter_bytes / base_bytes,
        "goal": (
            "adapter a few % of the base's bytes (ratio <= 0.10); the LoRA / full step ratio is tracked, "
            "not a target on the tiny base, where the adapters' extra matmuls outweigh the saved "
            "optimizer work"
        ),
        "model": "tiny",
        "steps": steps,
        "batch_size": batch,
        "max_length": max_length,
        "full_finetune_step_s": full,
        "lora_step_s": lora_s,
        "adapter_bytes": adapter_bytes,
        "base_bytes": base_bytes,
        "adapters_loaded": len(names),
        "set_adapter_us": {
            "median": float(np.median(latencies_us)),
            "p99": float(np.percentile(latencies_us, 99)),
        },
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
