"""The build_base stage: the ingested corpus -> the nimmerworld base model folder, tracked."""

from __future__ import annotations

import json
import math

import mlflow
from datasets import load_from_disk

from nimmer_train import tracking
from nimmer_train.artifacts import intact_manifest, read_manifest, write_json_atomic
from nimmer_train.base.build import BasePlan, BaseResult, SyntheticInput, build_base, plan
from nimmer_train.config import Config
from nimmer_train.corpus.ingest import IngestResult, ingest


def build_base_stage(
    cfg: Config,
    corpus: IngestResult | None = None,
    synth: SyntheticInput | None = None,
    pipeline: str = "build_base",
) -> BaseResult:
    """Build the base inside an MLflow run; a killed build resumes its checkpoints and its run.
    ``synth`` (the synthetic corpus) is needed when ``train.synthetic_share`` > 0."""
    if corpus is None:  # find the ingested corpus by fingerprint (ingest it if it is missing)
        corpus = ingest(cfg.corpus, cfg.paths.artifacts_dir())
    p = plan(cfg, corpus, synth)
    if intact_manifest(p.out) is not None and mlflow.active_run() is None:
        result = build_base(cfg, corpus, p, None, synth)  # up to date: no run, no work folder, no debris
    else:
        result = _tracked_build(cfg, corpus, synth, p, pipeline)
    m = result.metrics
    synthetic = (
        f"; on the synthetic dialogue's held-out scenes {m['initial_val_ppl_synthetic']:.1f} -> "
        f"{m['final_val_ppl_synthetic']:.1f}"
        if math.isfinite(m.get("final_val_ppl_synthetic", math.nan))
        else ""
    )
    before, after = (
        ("pretrained", "continued")
        if cfg.model.name_or_path or cfg.model.gguf_file
        else ("untrained", "trained")
    )
    print(
        f"base: {result.path} ({'reused' if result.reused else 'built'}); validation perplexity "
        f"{m['initial_val_ppl']:.1f} {before} -> {m['final_val_ppl']:.1f} {after}{synthetic}"
    )
    return result


def _tracked_build(
    cfg: Config, corpus: IngestResult, synth: SyntheticInput | None, p: BasePlan, pipeline: str
) -> BaseResult:
    run_file = p.work / "run.json"
    previous = json.loads(run_file.read_text())["run_id"] if run_file.exists() else None
    with tracking.stage_run(cfg, pipeline, "build_base", resume_run_id=previous) as run_id:
        if run_id:
            if intact_manifest(p.out) is None:  # a killed build resumes this run
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
            if synth is not None and cfg.train.synthetic_share > 0:  # r1 made part of the blocks
                _log_r1(synth)
            mlflow.set_tags({"dataset_fingerprint": corpus.fingerprint, "config_hash": p.fingerprint})
        result = build_base(cfg, corpus, p, run_id, synth)
        if run_id:
            _log_summary(result.metrics)
            mlflow.set_tags({"reused": str(result.reused), "model_dir": str(result.path)})
            tracking.log_manifest(result.path, read_manifest(result.path))
    return result


def _log_summary(metrics: dict) -> None:
    """The build's figures at the steps they belong to: the ``initial_`` ones before training
    (step 0), the rest at the last step, so that no summary point sits at step 0 after a curve."""
    figures = {
        k: v
        for k, v in metrics.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
    mlflow.log_metrics({k: v for k, v in figures.items() if k.startswith("initial_")}, step=0)
    mlflow.log_metrics(
        {k: v for k, v in figures.items() if not k.startswith("initial_")}, step=int(figures.get("steps", 0))
    )


def _log_r1(synth: SyntheticInput) -> None:
    """The synthetic r1 conversations the base mixes in (train) and scores on (validation)."""
    for split in ("train", "validation"):
        folder = synth.path / "r1" / split
        if folder.is_dir():
            context = "training" if split == "train" else split
            data = load_from_disk(str(folder))
            tracking.log_dataset(folder, f"synthetic-r1-{split}", synth.fingerprint, context, dataset=data)
