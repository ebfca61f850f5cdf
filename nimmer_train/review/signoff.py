"""The per-version sign-off (notebook 06): each published version's goals (voice, both epsilons,
the audits, the LoRA carry decisions) with pass / fail and the file that holds the evidence,
judged by :mod:`nimmer_train.publish.signoff` from the signed release folders; the same text is
the publish run's description in the MLflow UI."""

from __future__ import annotations

import dataclasses

import pandas as pd

from nimmer_train.publish import signoff as judge
from nimmer_train.review.sources import Sources
from nimmer_train.review.versions import registry


def versions(src: Sources) -> pd.DataFrame:
    """One row per version: its verdict and the count of goals per status."""
    rows = []
    with registry(src) as reg:
        for v in reg.versions():
            goals = judge.signoff(v.folder)
            counts = {s: sum(g.status == s for g in goals) for s in judge.STATUSES}
            rows.append({"version": v.label, "verdict": judge.verdict(goals), **counts})
    return pd.DataFrame(rows)


def goals(src: Sources, version: str) -> pd.DataFrame:
    """The goals of one version (a label, vN or alias), one row each, evidence paths absolute."""
    with registry(src) as reg:
        folder = reg.find(version).folder
    return pd.DataFrame(
        [{**dataclasses.asdict(g), "evidence": g.located(folder)} for g in judge.signoff(folder)]
    )


def markdown(src: Sources, version: str) -> str:
    """The sign-off section of one version, as the MLflow run description shows it."""
    with registry(src) as reg:
        folder = reg.find(version).folder
    return judge.markdown(folder)
