"""Tracked stages: each opens its MLflow run, calls the library, and logs what it produced.

Pipelines call exactly one of these; :func:`run_all` chains them under one parent run.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow
from datasets import load_from_disk

from nimmer_train import tracking
from nimmer_train.artifacts import read_manifest, sha256_file, write_json_atomic
from nimmer_train.build_base import BaseResult, build_base, plan
from nimmer_train.config import Config
from nimmer_train.ingest import IngestResult, corpus_folder, ingest
from nimmer_train.synthesize import SynthResult, synthesize

if TYPE_CHECKING:  # the later stages' imports (peft, trl, flwr) load only when run_all needs them
    from nimmer_train.federation.stage import FederationResult
    from nimmer_train.lora_stage import LoraResult
    from nimmer_train.publish.registry import Version

log = logging.getLogger(__name__)


def ingest_stage(cfg: Config, pipeline: str = "ingest") -> IngestResult:
    """Ingest the corpus inside an MLflow run: source lineage, figures, data card, manifest."""
    corpus_folder(cfg.corpus)  # a missing corpus fails before a run is opened
    with tracking.stage_run(cfg, pipeline, "ingest") as run_id:
        result = ingest(cfg.corpus, cfg.paths.artifacts_dir())
        if run_id:
            sources = Path(cfg.corpus.source_dir).resolve()
            tracking.log_dataset(sources, f"{cfg.corpus.name}-source", result.fingerprint, "source")
            stats = result.stats
            mlflow.log_metrics(
                {
                    "works": stats["works"],
                    "chunks": stats["chunks"],
                    "tokens": stats["tokens"],
                    "train_chunks": stats["splits"]["train"],
                    "validation_chunks": stats["splits"]["validation"],
                    "exact_duplicates_removed": stats["duplicates_removed"]["exact"],
                    "near_duplicates_removed": stats["duplicates_removed"]["near"],
                    "files_skipped": len(stats["skipped"]),
                }
            )
            mlflow.set_tags({"dataset_fingerprint": result.fingerprint, "reused": str(result.reused)})
            mlflow.log_artifact(str(result.path / "README.md"), "data_card")
            tracking.log_manifest(result.path, read_manifest(result.path))
    print(f"corpus: {result.path} ({'reused' if result.reused else 'built'})")
    return result


def build_base_stage(
    cfg: Config, corpus: IngestResult | None = None, pipeline: str = "build_base"
) -> BaseResult:
    """Build the base inside an MLflow run; a killed build resumes its checkpoints and its run."""
    if corpus is None:  # find the ingested corpus by fingerprint (ingest it if it is missing)
        corpus = ingest(cfg.corpus, cfg.paths.artifacts_dir())
    p = plan(cfg, corpus)
    run_file = p.work / "run.json"
    previous = json.loads(run_file.read_text())["run_id"] if run_file.exists() else None
    with tracking.stage_run(cfg, pipeline, "build_base", resume_run_id=previous) as run_id:
        if run_id:
            write_json_atomic(run_file, {"run_id": run_id})
            for split in ("train", "validation"):
                data = load_from_disk(str(corpus.dataset_dir / split))
                tracking.log_dataset(
                    corpus.dataset_dir / split,
                    f"{cfg.corpus.name}-{split}",
                    corpus.fingerprint,
                    split if split == "validation" else "training",
                    dataset=data,
                )
            mlflow.set_tags({"dataset_fingerprint": corpus.fingerprint, "config_hash": p.fingerprint})
        result = build_base(cfg, corpus, p, run_id)
        if run_id:
            mlflow.log_metrics(
                {k: v for k, v in result.metrics.items() if isinstance(v, int | float) and math.isfinite(v)}
            )
            mlflow.set_tags({"reused": str(result.reused), "model_dir": str(result.path)})
            tracking.log_manifest(result.path, read_manifest(result.path))
    m = result.metrics
    print(
        f"base: {result.path} ({'reused' if result.reused else 'built'}); validation perplexity "
        f"{m['initial_val_ppl']:.1f} untrained -> {m['final_val_ppl']:.1f} trained"
    )
    return result


def synthesize_stage(cfg: Config, pipeline: str = "synthesize") -> SynthResult:
    """Teacher-tier synthesis r0 -> r1 inside an MLflow run: counts, rejections, tokens, cost,
    a sample table and the data card."""
    with tracking.stage_run(cfg, pipeline, "synthesize") as run_id:
        result = synthesize(
            cfg.composition, cfg.registers, cfg.teacher, cfg.curation, cfg.paths.artifacts_dir()
        )
        if run_id:
            stats = result.stats
            if cfg.teacher.backend == "replay":
                replay = Path(str(cfg.teacher.replay_file))
                tracking.log_dataset(replay, replay.stem, sha256_file(replay), "teacher_replay")
            metrics = {
                "r0": stats["r0"],
                "r1": stats["r1"],
                "requested": stats["requested"],
                "cached": stats["cached"],
                "prompt_tokens": stats["tokens"]["prompt"],
                "completion_tokens": stats["tokens"]["completion"],
                "cost_usd_this_run": stats["cost_usd"]["this_run"],
                "cost_usd_corpus": stats["cost_usd"]["corpus_total"],
                **{f"rejected_{k}": v for k, v in stats["rejections"].items()},
                **{f"r1_{k}": v["r1"] for k, v in stats["per_register"].items()},
            }
            if stats["register_accuracy"] is not None:
                metrics["register_accuracy"] = stats["register_accuracy"]
            mlflow.log_metrics(metrics)
            mlflow.set_tags(
                {
                    "teacher_backend": stats["backend"],
                    "teacher_model": stats["model"],
                    "synth_fingerprint": result.fingerprint,
                    "reused": str(result.reused),
                }
            )
            mlflow.log_table(
                {k: [s[k] for s in result.samples] for k in result.samples[0]}
                if result.samples
                else {"utterance": []},
                "samples.json",
            )
            mlflow.log_artifact(str(result.path / "README.md"), "data_card")
            tracking.log_manifest(result.path, read_manifest(result.path))
    s = result.stats
    print(
        f"synthetic: {result.path} ({'reused' if result.reused else 'built'}); r0 {s['r0']}, "
        f"r1 {s['r1']}; rejected {s['rejections']}"
    )
    return result


def run_all(
    cfg: Config,
) -> tuple[IngestResult, SynthResult, BaseResult, LoraResult, FederationResult | None, list[Version]]:
    """Every stage in order, each a nested run under one parent run in experiment run_all."""
    from nimmer_train.federation.stage import federate_stage
    from nimmer_train.lora_stage import train_loras_stage
    from nimmer_train.publish.stage import publish_stage

    with tracking.stage_run(cfg, "run_all", "run_all"):
        corpus = ingest_stage(cfg, pipeline="run_all")
        synth = synthesize_stage(cfg, pipeline="run_all")
        base = build_base_stage(cfg, corpus, pipeline="run_all")
        loras = train_loras_stage(cfg, corpus, synth, base.path, pipeline="run_all")
        federation = federate_stage(cfg, loras, pipeline="run_all") if cfg.federated.enabled else None
        versions = (
            publish_stage(cfg, base.path, loras, federation, pipeline="run_all")
            if cfg.publish.enabled
            else []
        )
        if versions and cfg.runtime.enabled:  # the thin runtime speaks through what was published
            from nimmer_train.runtime.stage import speak_stage

            speak_stage(cfg, pipeline="run_all")
    return corpus, synth, base, loras, federation, versions
