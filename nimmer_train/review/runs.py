"""The last run_all: its stages with durations, inputs and outputs by fingerprint, the base's
loss and perplexity curves, and the data cards' figures (notebook 01)."""

from __future__ import annotations

import pandas as pd
from mlflow.entities import Run

from nimmer_train.review.sources import Sources, artifact_text, children, history, last_run, seconds

FINGERPRINT_TAGS = ("dataset_fingerprint", "synth_fingerprint", "config_hash", "federation", "base")
OUTPUT_TAGS = ("output", "model_dir", "adapter_dir", "federated_adapter")
BASE_CURVES = ["train_loss", "val_loss", "val_ppl"]
CARD_STAGES = ("ingest", "synthesize")


def last_run_all(src: Sources) -> Run:
    return last_run(src, "run_all", pipeline="run_all")


def _inputs(run: Run) -> str:
    found = run.inputs.dataset_inputs if run.inputs else []
    described = []
    for d in found:
        tags = {t.key: t.value for t in d.tags}
        digest = tags.get("sha256", d.dataset.digest)[:12]
        described.append(f"{d.dataset.name} ({tags.get('mlflow.data.context', '?')}) sha256:{digest}")
    return ", ".join(described)


def stages(src: Sources, parent: Run) -> pd.DataFrame:
    """One row per stage run under ``parent``: name, description, seconds, inputs, fingerprint, output."""
    rows = []
    for run in children(src, parent):
        tags = run.data.tags
        rows.append(
            {
                "stage": tags.get("stage", run.info.run_name),
                "run": run.info.run_name,
                "description": tags.get("mlflow.note.content", ""),
                "status": run.info.status,
                "seconds": seconds(run),
                "reused": tags.get("reused", ""),
                "inputs": _inputs(run),
                "fingerprint": next((tags[k][:12] for k in FINGERPRINT_TAGS if k in tags), ""),
                "output": next((tags[k] for k in OUTPUT_TAGS if k in tags), ""),
            }
        )
    return pd.DataFrame(rows)


def stage_run(src: Sources, parent: Run, stage: str) -> Run | None:
    return next((r for r in children(src, parent) if r.data.tags.get("stage") == stage), None)


def base_curves(src: Sources, parent: Run) -> pd.DataFrame:
    """Training and validation loss and validation perplexity of the base, by step (wide)."""
    run = stage_run(src, parent, "build_base")
    if run is None:
        return pd.DataFrame(columns=BASE_CURVES)
    long = history(src, run, [k for k in BASE_CURVES if k in run.data.metrics])
    return long.pivot_table(index="step", columns="metric", values="value")


def data_cards(src: Sources, parent: Run) -> dict[str, tuple[dict[str, float], str]]:
    """Per data-card stage (ingest, synthesize): its figures (metrics) and the card's markdown."""
    out = {}
    for stage in CARD_STAGES:
        run = stage_run(src, parent, stage)
        if run is not None:
            card = artifact_text(src, run, "data_card/README.md") or "(no data card logged)"
            out[stage] = (dict(sorted(run.data.metrics.items())), card)
    return out
