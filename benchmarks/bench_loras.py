"""Register LoRA costs, measured side by side in one process on the tiny base (model=tiny):

- seconds per optimizer step of LoRA SFT against a full fine-tune step (same data, batch,
  TRL SFTTrainer, assistant-only loss), and their ratio;
- adapter bytes against base bytes (safetensors on disk);
- set_adapter switch latency (median and p99) with all v1 register adapters loaded.

Writes benchmarks/results/bench_loras.json.  python -m benchmarks.bench_loras [--steps 12]
"""

from __future__ import annotations

import argparse
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


def conversations() -> list[list[dict[str, str]]]:
    """The seed set's conversations in the r1 training format."""
    replay = {}
    for line in (REPO / "data/seed/teacher_replay_v1.jsonl").read_text().splitlines():
        row = json.loads(line)
        replay[row["key"]] = row["response"]["content"]
    out = []
    for request in expand(composition(), load_catalogue()):
        out.append([*render_compact(request.prompt), {"role": "assistant", "content": replay[request.key]}])
    return out


def step_seconds(
    model: torch.nn.Module, tokenizer: object, data: Dataset, steps: int, tmp: str, lora: LoraConfig | None
) -> float:
    args = SFTConfig(
        output_dir=tmp,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        assistant_only_loss=True,
        max_length=512,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", choices=["tiny", "small"], default="tiny")
    args = parser.parse_args()
    catalogue = load_catalogue()
    convs = conversations()
    texts = [m["content"] for c in convs for m in c]
    tokenizer = train_bpe(texts, vocab_size=4096, model_max_length=512)
    mcfg = ModelConfig(name="tiny")  # the dataclass defaults are conf/model/tiny.yaml
    if args.model == "small":  # conf/model/small.yaml
        mcfg = ModelConfig(
            name="small",
            hidden_size=256,
            intermediate_size=704,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            max_position_embeddings=1024,
        )
    data = Dataset.from_dict({"messages": convs[:160]})
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.05, target_modules=TARGETS, task_type="CAUSAL_LM")

    def fresh() -> torch.nn.Module:
        return build_model(mcfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed=0)

    with tempfile.TemporaryDirectory() as tmp:
        full = step_seconds(fresh(), tokenizer, data, args.steps, f"{tmp}/full", None)
        lora_s = step_seconds(fresh(), tokenizer, data, args.steps, f"{tmp}/lora", lora)

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
    for i in range(2000):
        start = time.perf_counter()
        peft_model.set_adapter(names[i % len(names)])
        latencies.append(time.perf_counter() - start)
    latencies_us = np.array(latencies[100:]) * 1e6
    report = {
        "model": args.model,
        "steps": args.steps,
        "batch_size": 8,
        "torch_threads": torch.get_num_threads(),
        "full_finetune_step_s": full,
        "lora_step_s": lora_s,
        "lora_over_full_step_ratio": lora_s / full,
        "adapter_bytes": adapter_bytes,
        "base_bytes": base_bytes,
        "adapter_over_base_bytes": adapter_bytes / base_bytes,
        "adapters_loaded": len(names),
        "set_adapter_us": {
            "median": float(np.median(latencies_us)),
            "p99": float(np.percentile(latencies_us, 99)),
        },
    }
    out = Path(__file__).parent / "results" / f"bench_loras_{args.model}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"full fine-tune step {full:.3f} s, LoRA step {lora_s:.3f} s, ratio {lora_s / full:.2f}")
    print(
        f"adapter {adapter_bytes / 1e3:.0f} kB vs base {base_bytes / 1e6:.2f} MB "
        f"({100 * adapter_bytes / base_bytes:.1f}%)"
    )
    print(
        f"set_adapter with {len(names)} adapters loaded: median {report['set_adapter_us']['median']:.0f} us, "
        f"p99 {report['set_adapter_us']['p99']:.0f} us  -> {out}"
    )


if __name__ == "__main__":
    main()
