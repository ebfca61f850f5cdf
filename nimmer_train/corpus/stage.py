"""The ingest stage: the literary corpus -> a DatasetDict, its data card and manifest, tracked."""

from __future__ import annotations

from pathlib import Path

import mlflow

from nimmer_train import tracking
from nimmer_train.artifacts import README, read_manifest
from nimmer_train.config import Config
from nimmer_train.corpus.ingest import IngestResult, corpus_folder, ingest


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
            mlflow.log_artifact(str(result.path / README), "data_card")
            tracking.log_manifest(result.path, read_manifest(result.path))
    print(f"corpus: {result.path} ({'reused' if result.reused else 'built'})")
    return result
