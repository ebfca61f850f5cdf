"""The register LoRAs as a reviewer reads them (notebook 02): the register x adapter held-out loss
matrix, separability with its interval, the margin of each register per adapter set, and sample
turns side by side."""

from __future__ import annotations

from typing import Any

import pandas as pd
from mlflow.entities import Run

from nimmer_train.errors import NimmerError
from nimmer_train.review.sources import Sources, artifact_json, runs

SUMMARY = "evaluation/summary.json"
SAMPLES = "evaluation/samples.json"


def evaluation(src: Sources, run: Run) -> dict[str, Any] | None:
    """The evaluation summary a train_loras run logged (None when it evaluated nothing)."""
    return artifact_json(src, run, SUMMARY)


def last_evaluated(src: Sources) -> tuple[Run, dict[str, Any]]:
    """The newest train_loras run that evaluated adapters, with its summary (a run that skipped
    every register evaluated nothing); a clear error when there is none."""
    for run in runs(src, "train_loras"):
        summary = evaluation(src, run)
        if summary is not None:
            return run, summary
    raise NimmerError(
        f"no train_loras run in {src.tracking_uri} evaluated adapters: run "
        f"`python -m pipelines.train_loras paths.workdir={src.workdir}` with enough scenes per register"
    )


def matrix(summary: dict[str, Any], data: str | None = None, tokens: str | None = None) -> pd.DataFrame:
    """Held-out loss: one row per register's scenes, one column per adapter (``base``: none).
    The headline set and token class unless ``data`` / ``tokens`` name others."""
    data = data or summary["headline"]["set"]
    tokens = tokens or summary["headline"]["tokens"]
    scores = summary["scores"][data][tokens]["matrix"]
    return pd.DataFrame(
        {row: {col: cell["loss"] for col, cell in cols.items()} for row, cols in scores.items()}
    ).T


def headline(summary: dict[str, Any]) -> pd.DataFrame:
    """Separability and mean gain (value and interval) for every set and token class."""
    rows = []
    for data, by_class in summary["scores"].items():
        for tokens, score in by_class.items():
            for name in ("separability", "mean_gain"):
                est = score.get(name) or {}
                rows.append({"set": data, "tokens": tokens, "figure": name, **est})
    return pd.DataFrame(rows)


def quality_by_version(src: Sources) -> pd.DataFrame:
    """Every train_loras run's margin (base loss minus own-adapter loss) per register on the
    headline set, with the base it trained on: how the voices moved from one version to the next."""
    rows = []
    for run in runs(src, "train_loras"):
        metrics = run.data.metrics
        for key, value in metrics.items():
            parts = key.split(".")
            if parts[0] != "margin" or key.endswith(("_low", "_high")) or len(parts) != 4:
                continue
            rows.append(
                {
                    "run": run.info.run_name,
                    "base": run.data.tags.get("base", ""),
                    "set": parts[1],
                    "tokens": parts[2],
                    "register": parts[3],
                    "margin": value,
                    "low": metrics.get(f"{key}_low"),
                    "high": metrics.get(f"{key}_high"),
                }
            )
    return pd.DataFrame(rows)


def samples(src: Sources, run: Run) -> pd.DataFrame:
    """Sample turns side by side: one row per player line, one column per register's reply."""
    table = artifact_json(src, run, SAMPLES)
    if not table:
        return pd.DataFrame()
    frame = pd.DataFrame(table["data"], columns=table["columns"])
    return frame.pivot_table(index="player", columns="register", values="generated", aggfunc="first")
