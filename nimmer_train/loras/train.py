"""Register trait-LoRAs: one PEFT adapter per register, trained with TRL's SFTTrainer on the
register's r1 conversations plus slices of its literary affinities (the evaluation, a register x
adapter matrix of held-out losses, is in :mod:`nimmer_train.loras.evaluation`).

Each adapter lands in ``artifacts/loras/<base>/<register>-<fingerprint>/`` (atomically, with a
manifest); a finished adapter is never retrained, a killed one resumes from its last Trainer
checkpoint in the hidden work folder beside it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase, TrainerCallback
from transformers.trainer_callback import PrinterCallback

from nimmer_train.artifacts import (
    README,
    atomic_dir,
    fingerprint,
    source_fingerprint,
    write_json_atomic,
    write_manifest,
)
from nimmer_train.base.tokenizer import training_template
from nimmer_train.config import LoraConfig
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import METADATA
from nimmer_train.synth.synthesize import VALIDATION, VALIDATION_UNFILTERED
from nimmer_train.voice.registers import Register

log = logging.getLogger(__name__)

Conversation = list[dict[str, str]]
MetricLogger = Callable[[dict[str, float], int], None]
LORA_VERSION = 1


def check_hardware(settings: LoraConfig) -> None:
    """Fail up front when the chosen recipe cannot run here (QLoRA without CUDA/bitsandbytes)."""
    if not settings.quantize_4bit:
        return
    if not torch.cuda.is_available():
        raise NimmerError(
            "lora=qlora loads the base in 4-bit with bitsandbytes, which needs a CUDA GPU; "
            "none is visible here. Use lora=default (fp32 LoRA on CPU, bf16 on CUDA)."
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise NimmerError("lora=qlora needs bitsandbytes: pip install bitsandbytes") from exc


@dataclass(frozen=True)
class RegisterData:
    train: list[Conversation]
    heldout: dict[str, list[Conversation]]  # by evaluation set (loras.evaluation.EVAL_SETS)
    r1_examples: int
    literary_examples: int


def register_data(name: str, register: Register, r1: Any, corpus: Any, settings: LoraConfig) -> RegisterData:
    """The register's r1 conversations plus literary passages from its affinities (train), and
    the conversations of its held-out scenes (never trained on): the curated ones ("r1") and every
    schema-valid teacher reply before curation ("r0"), at most ``eval_max_examples`` of each."""
    train = [row["messages"] for row in r1["train"] if row["register"] == name]
    heldout = {
        "r1": [row["messages"] for row in r1[VALIDATION] if row["register"] == name],
        "r0": [row["messages"] for row in r1[VALIDATION_UNFILTERED] if row["register"] == name],
    }
    works = set(register.literary_affinities)
    chunks = [row for row in corpus["train"] if row["work"] in works]
    n_literary = min(len(chunks), round(settings.literary_weight * len(train)))
    rng = np.random.default_rng([settings.seed, len(name)])
    literary = [
        [
            {"role": "user", "content": f"Recite a passage from {row['title']} by {row['author']}."},
            {"role": "assistant", "content": row["text"][: settings.literary_chars]},
        ]
        for row in (chunks[i] for i in sorted(rng.choice(len(chunks), n_literary, replace=False)))
    ]
    mixed = train + literary
    order = rng.permutation(len(mixed))
    capped = {k: v[: settings.eval_max_examples] for k, v in heldout.items()}
    return RegisterData([mixed[i] for i in order], capped, len(train), n_literary)


def adapter_fingerprint(
    name: str, register: Register, base: dict[str, str], dataset_fps: dict[str, str], settings: LoraConfig
) -> str:
    settings_dict = {
        k: v
        for k, v in dataclasses.asdict(settings).items()
        if k not in ("registers", "base_dir", "eval_max_examples", "sample_max_new_tokens", "save_steps")
    }
    return fingerprint(
        {
            "version": LORA_VERSION,
            "code": source_fingerprint(sys.modules[__name__]),
            "register": name,
            "spec": dataclasses.asdict(register),
            "base": base["weights_sha256"],
            "datasets": dataset_fps,
            "lora": settings_dict,
        }
    )


class _LogMetrics(TrainerCallback):
    def __init__(self, log_fn: MetricLogger) -> None:
        self.log_fn = log_fn

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any
    ) -> None:
        keep = {
            k: float(v)
            for k, v in (logs or {}).items()
            if k in ("loss", "learning_rate", "grad_norm", "mean_token_accuracy")
        }
        if keep:
            self.log_fn({("train_loss" if k == "loss" else k): v for k, v in keep.items()}, state.global_step)


def train_adapter(
    name: str,
    data: RegisterData,
    base_dir: Path,
    settings: LoraConfig,
    target_modules: list[str],
    work: Path,
    log_fn: MetricLogger,
) -> tuple[Any, dict[str, float]]:
    """Train one LoRA (resuming from ``work``'s latest checkpoint); return (peft model, metrics)."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    tokenizer.chat_template = training_template(tokenizer)  # a pretrained ChatML one gets the markers
    model = _load_for_training(base_dir, settings)
    trainer = _sft_trainer(model, tokenizer, data, settings, target_modules, work, log_fn)
    resume = latest_complete_checkpoint(work / "checkpoints")
    if resume:
        log.info("%s: resuming from %s", name, resume)
    with warnings.catch_warnings():  # transformers 5 deprecates a name PEFT/TRL still call: not ours to fix
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        result = trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    moved = [p for n, p in trainer.model.named_parameters() if "lora_B" in n and p.abs().sum() > 0]
    if not moved:
        raise NimmerError(f"{name}: the LoRA weights did not change during training; nothing was learnt")
    return trainer.model, {"train_loss": float(result.training_loss), "steps": int(trainer.state.global_step)}


def _load_for_training(base_dir: Path, settings: LoraConfig) -> Any:
    """The base, in 4-bit NF4 for QLoRA, else as built (on its device before the adapter is attached)."""
    if not settings.quantize_4bit:
        from nimmer_train.loras.adapters import load_base

        return load_base(base_dir)
    from peft import prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
    )
    return prepare_model_for_kbit_training(
        AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quant)
    )


def _sft_trainer(
    model: Any,
    tokenizer: PreTrainedTokenizerBase,
    data: RegisterData,
    settings: LoraConfig,
    target_modules: list[str],
    work: Path,
    log_fn: MetricLogger,
) -> Any:
    """TRL's SFTTrainer: the LoRA on ``model``, loss on assistant turns, checkpoints in ``work``,
    metrics to ``log_fn`` (not stdout)."""
    from peft import LoraConfig as PeftLoraConfig
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    args = SFTConfig(
        output_dir=str(work / "checkpoints"),
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        gradient_accumulation_steps=settings.grad_accum_steps,
        learning_rate=settings.lr,
        lr_scheduler_type="cosine",
        warmup_steps=settings.warmup_steps,
        logging_steps=5,
        save_steps=settings.save_steps,
        save_total_limit=2,
        seed=settings.seed,
        data_seed=settings.seed,
        assistant_only_loss=True,
        max_length=settings.max_length,
        bf16=cuda or settings.dtype == "bfloat16",  # on CPU: autocast over float32 weights
        gradient_checkpointing=False,
        use_cpu=not cuda,
        report_to=[],
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    peft_config = PeftLoraConfig(
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(target_modules),
        layers_to_transform=top_layers(model, settings.top_layers),
        task_type="CAUSAL_LM",
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=Dataset.from_dict({"messages": data.train}),
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=[_LogMetrics(log_fn)],
    )
    trainer.remove_callback(PrinterCallback)  # metrics go to MLflow, not stdout
    return trainer


def top_layers(model: Any, count: int | None) -> list[int] | None:
    """The indices of ``model``'s top ``count`` decoder layers (``lora.top_layers``; None: every
    layer). Below the lowest adapted layer nothing needs a gradient, so the backward pass stops
    there: most of a step's cost on a 30-layer base (docs/config.md#experiment-presets)."""
    if count is None:
        return None
    layers = int(model.config.get_text_config().num_hidden_layers)
    if not 1 <= count <= layers:
        raise NimmerError(
            f"lora.top_layers={count}: the base has {layers} decoder layers; use 1..{layers} or null"
        )
    return list(range(layers - count, layers))


def latest_complete_checkpoint(folder: Path) -> Path | None:
    """The newest Trainer checkpoint that was written to the end (its trainer_state.json, saved
    last, parses); half-written ones left by a killed run are removed."""
    complete = []
    for checkpoint in folder.glob("checkpoint-*"):
        try:
            json.loads((checkpoint / "trainer_state.json").read_text())
            complete.append(checkpoint)
        except (OSError, ValueError):
            log.warning("removing incomplete checkpoint %s", checkpoint)
            shutil.rmtree(checkpoint, ignore_errors=True)
    return max(complete, key=lambda p: int(p.name.rsplit("-", 1)[1]), default=None)


def encode(
    tokenizer: PreTrainedTokenizerBase, conversation: Conversation, max_length: int
) -> dict[str, list[int]]:
    """Token ids and labels with the loss on assistant turns only (as in training; a pretrained
    ChatML template gets the generation markers it needs: :func:`training_template`)."""
    template = tokenizer.chat_template or ""
    if "generation %}" not in template:
        template = training_template(tokenizer)
    enc = tokenizer.apply_chat_template(
        conversation,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        chat_template=template,
    )
    ids, mask = enc["input_ids"][:max_length], enc["assistant_masks"][:max_length]
    return {"input_ids": ids, "labels": [t if m else -100 for t, m in zip(ids, mask, strict=True)]}


def compute_autocast(model: Any, dtype: str) -> Any:
    """bfloat16 autocast of ``model``'s matmuls where ``dtype`` (``lora.dtype``) asks for it, over
    its float32 weights; a no-op context for float32. (On this AVX512-BF16/AMX CPU a SmolLM2-135M
    LoRA step costs 0.60x the float32 CPU time, a held-out forward 0.53x: docs/config.md.)"""
    device = next(model.parameters()).device.type
    return torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "bfloat16")


@torch.no_grad()
def token_losses(
    model: Any, batch: list[dict[str, list[int]]], pad_id: int, dtype: str = "float32"
) -> list[np.ndarray]:
    """For each row of ``batch``, the loss (nats) of every labelled token at the token's own
    position (NaN where there is no label: the prompt, and the first position); the forward
    passes in ``dtype`` (:func:`compute_autocast`), the losses in float32."""
    with compute_autocast(model, dtype):
        return _token_losses(model, batch, pad_id)


def _token_losses(model: Any, batch: list[dict[str, list[int]]], pad_id: int) -> list[np.ndarray]:
    out: list[np.ndarray] = []
    device = next(model.parameters()).device
    for start in range(0, len(batch), 8):
        part = batch[start : start + 8]
        lengths = torch.tensor([len(x["input_ids"]) for x in part], device=device)
        width = int(lengths.max())
        ids = torch.tensor(
            [x["input_ids"] + [pad_id] * (width - len(x["input_ids"])) for x in part], device=device
        )
        labels = torch.tensor(
            [x["labels"] + [-100] * (width - len(x["labels"])) for x in part], device=device
        )
        attention = (torch.arange(width, device=device)[None, :] < lengths[:, None]).long()
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        target = labels[:, 1:]
        losses = torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), target, ignore_index=-100, reduction="none"
        )
        losses = losses.masked_fill(target == -100, float("nan")).cpu().double().numpy()
        for row, x in enumerate(part):
            out.append(np.concatenate([[np.nan], losses[row, : len(x["input_ids"]) - 1]]))
    return out


def heldout_loss(model: Any, batch: list[dict[str, list[int]]], pad_id: int) -> float:
    """Token-weighted mean loss over the assistant tokens of ``batch``."""
    losses = np.concatenate(token_losses(model, batch, pad_id) or [np.array([np.nan])])
    scored = losses[~np.isnan(losses)]
    return float(scored.sum() / max(len(scored), 1))


def publish_adapter(model: Any, out: Path, fp: str, metadata: dict[str, Any]) -> None:
    """Write the PEFT folder, its binding metadata and manifest; visible only when complete."""
    with atomic_dir(out) as staging:
        model.save_pretrained(staging)
        (staging / README).unlink(missing_ok=True)  # peft's empty model-card template
        write_json_atomic(staging / METADATA, metadata)
        write_manifest(
            staging, "register_adapter", fp, {"register": metadata["register"], "base": metadata["base"]}
        )
    shutil.rmtree(work_dir(out), ignore_errors=True)


def work_dir(out: Path) -> Path:
    return out.parent / f".work-{out.name}"
