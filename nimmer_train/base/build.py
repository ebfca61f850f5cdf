"""Build the nimmerworld base: tokenizer + causal LM trained on the ingested corpus.

The launching process plans the build (fingerprint, output and work folders), writes the
resolved config for the workers, and runs the worker in-process (``train.launcher=local``) or
as N processes under ``torchrun`` or ``accelerate launch``. Rank 0 logs metrics into the
launcher's MLflow run, so a distributed build is still one run. The finished model folder
(safetensors, tokenizer, config) is published atomically with a manifest of sha256 sums.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from datasets import load_from_disk

from nimmer_train.artifacts import (
    atomic_dir,
    fingerprint,
    git_commit,
    intact_manifest,
    source_fingerprint,
    write_json_atomic,
    write_manifest,
)
from nimmer_train.base.modeling import build_model, count_parameters
from nimmer_train.base.pretrain import pack_blocks, train
from nimmer_train.base.tokenizer import load_pretrained, train_bpe
from nimmer_train.config import Config, load_config, save_config
from nimmer_train.corpus.ingest import IngestResult
from nimmer_train.errors import NimmerError
from nimmer_train.progress import Progress, with_progress
from nimmer_train.tracking import metric_logger

log = logging.getLogger(__name__)

BUILD_VERSION = 1
_NOT_SEMANTIC = (
    "log_every",
    "eval_every",
    "eval_batches",
    "checkpoint_every",
    "keep_checkpoints",
    "launcher",
    "accelerate_config",
)


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


def plan(cfg: Config, corpus: IngestResult) -> BasePlan:
    train_cfg = {k: v for k, v in dataclasses.asdict(cfg.train).items() if k not in _NOT_SEMANTIC}
    from nimmer_train.base import modeling, pretrain, tokenizer

    code = source_fingerprint(modeling, pretrain, tokenizer, sys.modules[__name__])
    fp = fingerprint(
        {
            "version": BUILD_VERSION,
            "code": code,
            "dataset": corpus.fingerprint,
            "model": dataclasses.asdict(cfg.model),
            "train": train_cfg,
        }
    )
    root = cfg.paths.artifacts_dir() / "base"
    name = f"{cfg.model.name}-{fp[:12]}"
    return BasePlan(fp, root / name, root / f".work-{name}")


def build_base(cfg: Config, corpus: IngestResult, p: BasePlan, run_id: str | None) -> BaseResult:
    """Train (or resume) the base described by ``p`` and publish it; reuse it if published."""
    existing = intact_manifest(p.out)
    if existing:
        log.info("base %s is up to date; nothing to do", p.out)
        return BaseResult(p.out, p.fingerprint, existing["lineage"]["metrics"], reused=True)
    p.work.mkdir(parents=True, exist_ok=True)
    save_config(cfg, p.work / "config.yaml")
    write_json_atomic(
        p.work / "inputs.json",
        {
            "dataset_dir": str(corpus.dataset_dir),
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
            "config_hash": p.fingerprint,
            "git_commit": git_commit(),
            "model": dataclasses.asdict(cfg.model),
            "train": dataclasses.asdict(cfg.train),
            "metrics": result,
        }
        write_manifest(staging, "base", p.fingerprint, lineage)
    shutil.rmtree(p.work, ignore_errors=True)
    return BaseResult(p.out, p.fingerprint, result, reused=False)


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
    mixed = "bf16" if cfg.model.dtype == "bfloat16" else "no"
    accelerator = Accelerator(mixed_precision=mixed, cpu=not torch.cuda.is_available())
    expected = int(os.environ.get("WORLD_SIZE", "1"))
    if accelerator.num_processes != expected:
        raise RuntimeError(
            f"launched as {expected} processes but Accelerator sees "
            f"{accelerator.num_processes}; distributed set-up failed"
        )
    set_seed(cfg.train.seed)
    dataset = load_from_disk(inputs["dataset_dir"])
    with accelerator.main_process_first():
        tokenizer = _tokenizer(cfg, dataset, work / "tokenizer", accelerator.is_main_process)
        blocks = {
            split: _blocks(
                tokenizer,
                dataset[split]["text"],
                cfg.train.seq_len,
                work / f"blocks-{split}.npy",
                accelerator.is_main_process,
            )
            for split in ("train", "validation")
        }
    if len(blocks["train"]) == 0:
        raise NimmerError(f"the train split has fewer than train.seq_len={cfg.train.seq_len} tokens")
    model = build_model(
        cfg.model, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, cfg.train.seed
    )
    logger = metric_logger(inputs["run_id"] if accelerator.is_main_process else None, inputs["tracking_uri"])
    progress = Progress("build_base", cfg.train.max_steps) if accelerator.is_main_process else None
    try:
        state = train(
            model,
            blocks["train"],
            blocks["validation"],
            cfg.train,
            accelerator,
            work / "checkpoints",
            with_progress(logger, progress) if progress else logger,
        )
    finally:
        if progress:
            progress.close()
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)
    if accelerator.is_main_process:
        out = work / "model"
        shutil.rmtree(out, ignore_errors=True)
        accelerator.unwrap_model(model).save_pretrained(out, state_dict=state_dict)
        tokenizer.save_pretrained(out)
        evals = [h for h in state.history if "val_loss" in h]
        trains = [h for h in state.history if "train_loss" in h]
        write_json_atomic(
            work / "result.json",
            {
                "steps": state.step,
                "tokens": state.tokens,
                "parameters": count_parameters(accelerator.unwrap_model(model)),
                "initial_val_loss": evals[0]["val_loss"] if evals else math.nan,
                "initial_val_ppl": evals[0]["val_ppl"] if evals else math.nan,
                "final_val_loss": evals[-1]["val_loss"] if evals else math.nan,
                "final_val_ppl": evals[-1]["val_ppl"] if evals else math.nan,
                "final_train_loss": trains[-1]["train_loss"] if trains else math.nan,
                "train_blocks": len(blocks["train"]),
                "validation_blocks": len(blocks["validation"]),
                "processes": accelerator.num_processes,
            },
        )
    accelerator.wait_for_everyone()
    accelerator.end_training()


def _tokenizer(cfg: Config, dataset: Any, folder: Path, main: bool) -> Any:
    """Train the BPE tokenizer once (rank 0) and reload it everywhere else and on resume."""
    if cfg.model.tokenizer == "pretrained":
        return load_pretrained(str(cfg.model.name_or_path))
    if not (folder / "tokenizer.json").exists():
        if not main:
            raise RuntimeError("rank 0 did not write the tokenizer")
        tok = train_bpe(dataset["train"]["text"], cfg.model.vocab_size, cfg.model.max_position_embeddings)
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
