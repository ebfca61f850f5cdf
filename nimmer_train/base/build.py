"""Build the nimmerworld base: tokenizer + causal LM trained on the ingested corpus.

The launching process plans the build (fingerprint, output and work folders), writes the
resolved config for the workers, and runs the worker in-process (``train.launcher=local``) or
as N processes under ``torchrun`` or ``accelerate launch``. Rank 0 logs metrics into the
launcher's MLflow run, so a distributed build is still one run. The finished model folder
(safetensors, tokenizer, config) is published atomically with a manifest of sha256 sums.

A pretrained starting point (``model.name_or_path``, or ``model.gguf_package``: converted once by
:mod:`nimmer_train.base.from_gguf`) continues pretraining on the corpus, every weight or a LoRA
(``model.continued_lora_rank``) merged into the published weights; the manifest names its origin.

Worker entry: ``python -m nimmer_train.base.build WORK_DIR``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_from_disk

from nimmer_train.artifacts import (
    README,
    artifact_name,
    atomic_dir,
    base_path,
    fingerprint,
    git_commit,
    intact_manifest,
    read_manifest,
    source_fingerprint,
    write_json_atomic,
    write_manifest,
)
from nimmer_train.base.from_gguf import pretrained_folder
from nimmer_train.base.modeling import build_model, count_parameters, merged, with_lora
from nimmer_train.base.pretrain import TrainState, batch_indices, pack_blocks, train
from nimmer_train.base.tokenizer import load_pretrained, train_bpe
from nimmer_train.config import Config, TrainConfig, load_config, save_config
from nimmer_train.corpus.ingest import IngestResult
from nimmer_train.errors import NimmerError
from nimmer_train.progress import Progress, with_progress
from nimmer_train.tracking import metric_logger

log = logging.getLogger(__name__)

BUILD_VERSION = 2  # 2: the base mixes in the synthetic dialogue (train.synthetic_share)
VALIDATION_SPLIT = "validation"  # the synthetic r1 split of held-out scenes
_NOT_SEMANTIC = (
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "launcher",
    "accelerate_config",
)


class SyntheticInput(Protocol):
    """The teacher-tier synthetic corpus a base mixes in (the synth stage's result)."""

    path: Path  # holds r1/, a DatasetDict of conversations ("messages") with a train split
    fingerprint: str


@dataclass(frozen=True)
class BasePlan:
    fingerprint: str
    out: Path  # the published model folder
    work: Path  # checkpoints and worker files while building


@dataclass(frozen=True)
class BaseResult:
    path: Path
    fingerprint: str
    metrics: dict[str, Any]
    reused: bool


def plan(cfg: Config, corpus: IngestResult, synthetic: SyntheticInput | None = None) -> BasePlan:
    """Where the base for this config and these corpora lives; ``synthetic`` is required when
    ``train.synthetic_share`` > 0 (the base is built from both corpora) and ignored otherwise."""
    train_cfg = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _NOT_SEMANTIC}
    from nimmer_train.base import from_gguf, modeling, pretrain, tokenizer

    code = source_fingerprint(from_gguf, modeling, pretrain, tokenizer, sys.modules[__name__])
    datasets = {"literary": corpus.fingerprint}
    if cfg.train.synthetic_share > 0:
        if synthetic is None:
            raise NimmerError(
                f"train.synthetic_share={cfg.train.synthetic_share} builds the base from the literary and "
                "the synthetic corpus, and no synthetic corpus was given: run `python -m "
                "pipelines.synthesize` with the same overrides first, or set train.synthetic_share=0"
            )
        datasets["synthetic"] = synthetic.fingerprint
    fp = fingerprint(
        {
            "version": BUILD_VERSION,
            "code": code,
            "dataset": corpus.fingerprint if len(datasets) == 1 else datasets,
            "model": dataclasses.asdict(cfg.model),
            "train": train_cfg,
        }
    )
    out = base_path(cfg.paths.artifacts_dir(), artifact_name(cfg.model.name, fp))
    return BasePlan(fp, out, out.with_name(f".work-{out.name}"))


def build_base(
    cfg: Config,
    corpus: IngestResult,
    p: BasePlan,
    run_id: str | None,
    synthetic: SyntheticInput | None = None,
) -> BaseResult:
    """Train (or resume) the base described by ``p`` and publish it; reuse it if published."""
    existing = intact_manifest(p.out)
    if existing:
        log.info("base %s is up to date; nothing to do", p.out)
        return BaseResult(p.out, p.fingerprint, existing["lineage"]["metrics"], reused=True)
    origin = _origin(cfg)
    if cfg.model.gguf_package:  # the workers load the converted folder
        folder = Path(origin["pretrained_dir"])
        cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, name_or_path=str(folder)))
    p.work.mkdir(parents=True, exist_ok=True)
    save_config(cfg, p.work / "config.yaml")
    write_json_atomic(
        p.work / "inputs.json",
        {
            "dataset_dir": str(corpus.dataset_dir),
            "synthetic_dir": str(synthetic.path / "r1")
            if synthetic and cfg.train.synthetic_share > 0
            else None,
            "run_id": run_id,
            "tracking_uri": cfg.tracking.tracking_uri() if cfg.tracking.enabled else None,
        },
    )
    started = time.perf_counter()
    if cfg.train.launcher == "local":
        worker(p.work)
    else:
        cmd = launch_command(cfg, p.work)
        log.info("launching %s", " ".join(cmd))
        code = subprocess.run(cmd).returncode
        if code:
            raise NimmerError(
                f"distributed build_base failed (exit {code}); see the worker output "
                "above. Re-run the same command to resume from the last checkpoint."
            )
    result = json.loads((p.work / "result.json").read_text())
    result["wall_s"] = time.perf_counter() - started
    with atomic_dir(p.out) as staging:
        for item in (p.work / "model").iterdir():
            shutil.move(str(item), staging / item.name)
        lineage = {
            "dataset_fingerprint": corpus.fingerprint,
            "dataset_dir": str(corpus.dataset_dir),
            "training_corpus_refs": _corpus_refs(cfg, corpus, synthetic, result),
            "config_hash": p.fingerprint,
            "git_commit": git_commit(),
            "model": dataclasses.asdict(cfg.model),
            "train": dataclasses.asdict(cfg.train),
            "metrics": result,
        }
        if origin:
            lineage["origin"] = origin
            (staging / README).write_text(_card(cfg, origin, result))
        write_manifest(staging, "base", p.fingerprint, lineage)
    shutil.rmtree(p.work, ignore_errors=True)
    return BaseResult(p.out, p.fingerprint, result, reused=False)


def _origin(cfg: Config) -> dict[str, Any]:
    """The checkpoint a pretrained base starts from (converting a GGUF once); {} for a new model."""
    if cfg.model.gguf_package:
        folder = pretrained_folder(cfg.model, cfg.paths.artifacts_dir())
        converted = read_manifest(folder)
        return {
            "checkpoint": cfg.model.origin,
            "license": cfg.model.license,
            "gguf": converted["lineage"]["gguf"],
            "pretrained_dir": str(folder),
            "pretrained_fingerprint": converted["fingerprint"],
        }
    if cfg.model.name_or_path:
        return {
            "checkpoint": cfg.model.origin or cfg.model.name_or_path,
            "license": cfg.model.license,
            "pretrained_dir": cfg.model.name_or_path,
        }
    return {}


def _card(cfg: Config, origin: dict[str, Any], result: dict[str, Any]) -> str:
    """The base's model card: where its weights come from and what continued pretraining did."""
    how = (
        f"a LoRA of rank {cfg.model.continued_lora_rank} on {', '.join(cfg.model.lora_target_modules)}, "
        "merged into the weights"
        if cfg.model.continued_lora_rank
        else "every weight trained"
    )
    gguf = origin.get("gguf")
    source = f" (from `{gguf['file']}` in `{gguf['package']}`, sha256 `{gguf['sha256']}`)" if gguf else ""
    return (
        f"# {cfg.model.name} base: {origin['checkpoint']}, continued on {cfg.corpus.name}\n\n"
        f"- Origin: {origin['checkpoint']}{source}; licence: {origin['license'] or 'not stated'}\n"
        f"- Continued pretraining: {result['steps']} steps, {result['tokens']:,} tokens in blocks of "
        f"{cfg.train.seq_len}, {how}\n"
        f"- Validation perplexity ({cfg.corpus.name} validation split): {result['initial_val_ppl']:.2f} "
        f"pretrained -> {result['final_val_ppl']:.2f} after\n"
    )


def _corpus_refs(
    cfg: Config, corpus: IngestResult, synthetic: SyntheticInput | None, result: dict[str, Any]
) -> dict[str, Any]:
    """What the base was trained on: each corpus's fingerprint, folder and training tokens, the mix."""
    refs: dict[str, Any] = {
        "literary": {
            "fingerprint": corpus.fingerprint,
            "dataset_dir": str(corpus.dataset_dir),
            "train_tokens": result["tokens_by_corpus"]["literary"],
        },
        "mix": {"synthetic_share": cfg.train.synthetic_share, "order": "interleaved (one shuffle per epoch)"},
    }
    if synthetic is not None and cfg.train.synthetic_share > 0:
        refs["synthetic"] = {
            "fingerprint": synthetic.fingerprint,
            "dataset_dir": str(synthetic.path / "r1"),
            "split": "train (held-out scenes stay out)",
            "train_tokens": result["tokens_by_corpus"]["synthetic"],
            "repeats": result["synthetic_repeats"],
        }
    return refs


def launch_command(cfg: Config, work: Path) -> list[str]:
    """The multi-process command for the worker: torchrun (DDP) or accelerate launch (DDP/FSDP)."""
    module = ["-m", "nimmer_train.base.build", str(work)]
    if cfg.train.launcher == "torchrun":
        return [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={cfg.train.nproc}",
            *module,
        ]
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(cfg.train.accelerate_config),
        "--num_processes",
        str(cfg.train.nproc),
        *module,
    ]


def worker(work: Path) -> None:
    """Train in this process (one rank of a distributed job, or the only one)."""
    cfg = load_config(work / "config.yaml")
    inputs = json.loads((work / "inputs.json").read_text())
    accelerator = _accelerator(cfg)
    set_seed(cfg.train.seed)
    dataset = load_from_disk(inputs["dataset_dir"])
    synthetic = load_from_disk(inputs["synthetic_dir"]) if inputs.get("synthetic_dir") else None
    tokenizer, blocks = _tokenized(cfg, work, dataset, synthetic, accelerator)
    if len(blocks["train"]) == 0:
        raise NimmerError(f"the train split has fewer than train.seq_len={cfg.train.seq_len} tokens")
    literary_blocks = len(blocks["train"])
    train_blocks, repeats = mix_blocks(
        blocks["train"], blocks.get("synthetic-train"), cfg.train.synthetic_share, cfg.train.seed
    )
    model = build_model(
        cfg.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.train.seed
    )
    if cfg.model.continued_lora_rank:
        model = with_lora(model, cfg.model)
    logger = metric_logger(inputs["run_id"] if accelerator.is_main_process else None, inputs["tracking_uri"])
    progress = Progress("build_base", cfg.train.max_steps) if accelerator.is_main_process else None
    try:
        state = train(
            model,
            train_blocks,
            blocks["validation"],
            cfg.train,
            accelerator,
            work / "checkpoints",
            with_progress(logger, progress) if progress else logger,
            extra_val={"synthetic": blocks["synthetic-validation"]} if synthetic is not None else None,
        )
    finally:
        if progress:
            progress.close()
    accelerator.wait_for_everyone()
    lora = bool(cfg.model.continued_lora_rank)
    state_dict = None if lora else accelerator.get_state_dict(model)  # a LoRA merges on rank 0 (DDP)
    if accelerator.is_main_process:
        out = work / "model"
        shutil.rmtree(out, ignore_errors=True)
        trainable = count_parameters(accelerator.unwrap_model(model), trainable=True)
        published = merged(accelerator.unwrap_model(model))
        published.save_pretrained(out, state_dict=state_dict)
        tokenizer.save_pretrained(out)
        mix = _Mix(len(train_blocks), literary_blocks, repeats)
        result = _result(cfg, state, count_parameters(published), trainable, mix, blocks, accelerator)
        write_json_atomic(work / "result.json", result)
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _accelerator(cfg: Config) -> Accelerator:
    """This rank's Accelerator; RuntimeError when it does not see the processes it was launched as."""
    mixed = "bf16" if cfg.model.dtype == "bfloat16" else "no"
    accelerator = Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available())
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"launched as {expected} processes but Accelerator sees "
            f"{accelerator.num_processes}; distributed set-up failed"
        )
    return accelerator


def _tokenized(
    cfg: Config, work: Path, dataset: Any, synthetic: Any | None, accelerator: Accelerator
) -> tuple[Any, dict[str, torch.Tensor]]:
    """The tokenizer and the token blocks of every split (literary train/validation, the
    synthetic turns rendered with the chat template), made on rank 0 first and reloaded by the
    others."""
    main = accelerator.is_main_process
    with accelerator.main_process_first():
        tokenizer = _tokenizer(cfg, _tokenizer_texts(dataset, synthetic), work / "tokenizer", main)
        texts = {split: dataset[split]["text"] for split in ("train", "validation")}
        if synthetic is not None:
            for split, name in (("train", "synthetic-train"), (VALIDATION_SPLIT, "synthetic-validation")):
                texts[name] = [
                    tokenizer.apply_chat_template(messages, tokenize=False)
                    for messages in synthetic[split]["messages"]
                ]
        blocks = {
            name: _blocks(tokenizer, part, cfg.train.seq_len, work / f"blocks-{name}.npy", main)
            for name, part in texts.items()
        }
    return tokenizer, blocks


@dataclass(frozen=True)
class _Mix:
    """The training blocks as mixed: how many, how many literary, the synthetic set's passes."""

    train: int
    literary: int
    repeats: float


def _result(
    cfg: Config,
    state: TrainState,
    parameters: int,
    trainable: int,
    mix: _Mix,
    blocks: dict[str, torch.Tensor],
    accelerator: Accelerator,
) -> dict[str, Any]:
    """The worker's ``result.json``: steps, tokens, losses and the corpus mix, for the launcher."""
    evals = [h for h in state.history if "val_loss" in h]
    trains = [h for h in state.history if "train_loss" in h]
    synth_evals = [h for h in state.history if "val_loss_synthetic" in h]
    return {
        "steps": state.step,
        "tokens": state.tokens,
        "parameters": parameters,
        "trainable_parameters": trainable,
        "initial_val_loss": evals[0]["val_loss"] if evals else math.nan,
        "initial_val_ppl": evals[0]["val_ppl"] if evals else math.nan,
        "final_val_loss": evals[-1]["val_loss"] if evals else math.nan,
        "final_val_ppl": evals[-1]["val_ppl"] if evals else math.nan,
        "final_train_loss": trains[-1]["train_loss"] if trains else math.nan,
        "initial_val_ppl_synthetic": synth_evals[0]["val_ppl_synthetic"] if synth_evals else math.nan,
        "final_val_ppl_synthetic": synth_evals[-1]["val_ppl_synthetic"] if synth_evals else math.nan,
        "train_blocks": mix.train,
        "literary_train_blocks": mix.literary,
        "synthetic_train_blocks": mix.train - mix.literary,
        "synthetic_repeats": mix.repeats,
        "tokens_by_corpus": tokens_by_corpus(
            cfg.train, mix.train, mix.literary, state.step, accelerator.num_processes
        ),
        "validation_blocks": len(blocks["validation"]),
        "synthetic_validation_blocks": len(blocks.get("synthetic-validation", ())),
        "processes": accelerator.num_processes,
    }


def mix_blocks(
    literary: torch.Tensor, synthetic: torch.Tensor | None, share: float, seed: int
) -> tuple[torch.Tensor, float]:
    """The training blocks: all literary blocks plus synthetic ones making up ``share`` of the
    total (the synthetic set repeated in shuffled passes when it is shorter); and how many times
    the synthetic set is used (e.g. 2.4). The trainer shuffles them together every epoch."""
    if synthetic is None or share <= 0 or not len(synthetic):
        return literary, 0.0
    want = round(share / (1 - share) * len(literary))
    rng = np.random.default_rng([seed, 7])
    passes = -(-want // len(synthetic))
    order = np.concatenate([rng.permutation(len(synthetic)) for _ in range(passes)])[:want]
    return torch.cat([literary, synthetic[torch.from_numpy(order)]]), want / len(synthetic)


def tokens_by_corpus(cfg: TrainConfig, n: int, literary: int, steps: int, world: int) -> dict[str, int]:
    """Training tokens the sampler drew from each corpus in ``steps`` steps (blocks below index
    ``literary`` are literary, the rest synthetic): exact, from the same batch indices."""
    synthetic = total = 0
    for step in range(steps):
        for micro in range(cfg.grad_accum_steps):
            for rank in range(world):
                drawn = batch_indices(step, micro, cfg, rank, world, n)
                synthetic += int((drawn >= literary).sum())
                total += len(drawn)
    return {"literary": (total - synthetic) * cfg.seq_len, "synthetic": synthetic * cfg.seq_len}


def _tokenizer_texts(dataset: Any, synthetic: Any | None) -> Iterator[str]:
    """What a trained tokenizer learns from: the literary train split and the synthetic turns."""
    yield from dataset["train"]["text"]
    if synthetic is not None:
        for messages in synthetic["train"]["messages"]:
            yield from (m["content"] for m in messages)


def _tokenizer(cfg: Config, texts: Iterable[str], folder: Path, main: bool) -> Any:
    """Train the BPE tokenizer once (rank 0) and reload it everywhere else and on resume."""
    if cfg.model.tokenizer == "pretrained":
        return load_pretrained(str(cfg.model.name_or_path))
    if not (folder / "tokenizer.json").exists():
        if not main:
            raise RuntimeError("rank 0 did not write the tokenizer")
        tok = train_bpe(texts, cfg.model.vocab_size, cfg.model.max_position_embeddings)
        with atomic_dir(folder) as staging:
            tok.save_pretrained(staging)
    return load_pretrained(str(folder))


def _blocks(tokenizer: Any, texts: Any, seq_len: int, cache: Path, main: bool) -> torch.Tensor:
    """Packed token blocks, cached beside the checkpoints so workers and resumes reuse them."""
    if not cache.exists():
        if not main:
            raise RuntimeError("rank 0 did not write the token blocks")
        ids = tokenizer(list(texts), add_special_tokens=False, verbose=False)["input_ids"]
        blocks = pack_blocks(ids, tokenizer.eos_token_id, seq_len).numpy()
        tmp = cache.with_suffix(".tmp.npy")
        np.save(tmp, blocks)
        tmp.replace(cache)
    return torch.from_numpy(np.load(cache))


if __name__ == "__main__":
    worker(Path(sys.argv[1]))
