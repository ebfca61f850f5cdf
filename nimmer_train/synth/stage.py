"""The synthesize stage: the composition spec -> teacher replies r0 -> curated r1, tracked."""

from __future__ import annotations

from pathlib import Path

import mlflow

from nimmer_train import tracking
from nimmer_train.artifacts import README, read_manifest, sha256_file
from nimmer_train.config import Config
from nimmer_train.synth.synthesize import SAMPLES, SynthResult, synthesize


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
            for key in ("register_accuracy", "completion_tokens_per_s"):
                if stats.get(key) is not None:
                    metrics[key] = stats[key]
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
                SAMPLES,
            )
            mlflow.log_artifact(str(result.path / README), "data_card")
            tracking.log_manifest(result.path, read_manifest(result.path))
    s = result.stats
    print(
        f"synthetic: {result.path} ({'reused' if result.reused else 'built'}); r0 {s['r0']}, "
        f"r1 {s['r1']}; rejected {s['rejections']}; {s['requested']} requested, {s['cached']} from cache"
        + (f" ({s['completion_tokens_per_s']:.1f} tokens/s)" if s.get("completion_tokens_per_s") else "")
    )
    return result
