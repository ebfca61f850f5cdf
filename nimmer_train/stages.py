"""Tracked stages: each opens its MLflow run, calls the library, and logs what it produced.

Pipelines call exactly one of these; :func:`run_all` chains them under one parent run.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import mlflow
from datasets import load_from_disk

from nimmer_train import tracking
from nimmer_train.artifacts import read_manifest, write_json_atomic
from nimmer_train.build_base import BaseResult, build_base, plan
from nimmer_train.config import Config
from nimmer_train.ingest import IngestResult, ingest

log = logging.getLogger(__name__)


def ingest_stage(cfg: Config, pipeline: str = "ingest") -> IngestResult:
    """Ingest the corpus inside an MLflow run: source lineage, figures, data card, manifest."""
    with tracking.stage_run(cfg, pipeline, "ingest") as run_id:
        result = ingest(cfg.corpus, cfg.paths.artifacts_dir())
        if run_id:
            sources = Path(cfg.corpus.source_dir).resolve()
            tracking.log_dataset(sources, f"{cfg.corpus.name}-source", result.fingerprint, "source")
            stats = result.stats
            mlflow.log_metrics({
                "works": stats["works"], "chunks": stats["chunks"], "tokens": stats["tokens"],
                "train_chunks": stats["splits"]["train"],
                "validation_chunks": stats["splits"]["validation"],
                "exact_duplicates_removed": stats["duplicates_removed"]["exact"],
                "near_duplicates_removed": stats["duplicates_removed"]["near"],
                "files_skipped": len(stats["skipped"]),
            })
            mlflow.set_tags({"dataset_fingerprint": result.fingerprint, "reused": str(result.reused)})
            mlflow.log_artifact(str(result.path / "README.md"), "data_card")
            tracking.log_manifest(result.path, read_manifest(result.path))
    print(f"corpus: {result.path} ({'reused' if result.reused else 'built'})")
    return result


def build_base_stage(cfg: Config, corpus: IngestResult | None = None,
                     pipeline: str = "build_base") -> BaseResult:
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
                tracking.log_dataset(corpus.dataset_dir / split, f"{cfg.corpus.name}-{split}",
                                     corpus.fingerprint, split if split == "validation" else "training",
                                     dataset=data)
            mlflow.set_tags({"dataset_fingerprint": corpus.fingerprint, "config_hash": p.fingerprint})
        result = build_base(cfg, corpus, p, run_id)
        if run_id:
            mlflow.log_metrics({k: v for k, v in result.metrics.items()
                                if isinstance(v, int | float) and math.isfinite(v)})
            mlflow.set_tags({"reused": str(result.reused), "model_dir": str(result.path)})
            tracking.log_manifest(result.path, read_manifest(result.path))
    m = result.metrics
    print(f"base: {result.path} ({'reused' if result.reused else 'built'}); validation perplexity "
          f"{m['initial_val_ppl']:.1f} untrained -> {m['final_val_ppl']:.1f} trained")
    return result


def run_all(cfg: Config) -> tuple[IngestResult, BaseResult]:
    """Every stage in order, each a nested run under one parent run in experiment run_all."""
    with tracking.stage_run(cfg, "run_all", "run_all"):
        corpus = ingest_stage(cfg, pipeline="run_all")
        base = build_base_stage(cfg, corpus, pipeline="run_all")
    return corpus, base
