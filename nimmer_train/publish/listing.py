"""The registry's versions as a table: ``nimmer versions list`` and the end of publish/run_all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def print_versions(releases: Path) -> None:
    """The registry's versions as a table (``nimmer versions list``)."""
    from nimmer_train.publish.registry import Registry

    registry = Registry.open(releases)
    try:
        aliases: dict[str, list[str]] = {}
        for alias, label in registry.aliases().items():
            aliases.setdefault(label, []).append(alias)
        header = (
            "version",
            "released_at",
            "eps A.1 user-level",
            "eps A.2 record-level",
            "contributors",
            "loras",
            "parent",
            "mlflow",
            "aliases",
        )
        rows = [header]
        parents = {v.id: v.label for v in registry.versions()}
        for v in registry.versions():
            r = v.row
            report = privacy_report(v.folder)
            a2 = report.get("epsilon_a2_record_level", r["differential_privacy_epsilon"])
            rows.append(
                (
                    v.label,
                    r["released_at"],
                    _epsilon(report.get("epsilon_a1_user_level"), report),
                    _epsilon(a2, report),
                    str(r["contributors_count"]),
                    str(len(registry.loras_for(v))),
                    parents.get(r["parent_version_id"], "-"),
                    r["mlflow_model_version"] or "-",
                    ",".join(sorted(aliases.get(v.label, []))) or "-",
                )
            )
    finally:
        registry.close()
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def _epsilon(value: float | None, report: dict[str, Any]) -> str:
    """An epsilon for the table: the figure, "none" where a mechanism ran without noise (no
    guarantee), "-" where no player data went in."""
    if value is not None:
        return f"{value:.3f}"
    return "none" if report.get("no_privacy") else "-"


def privacy_report(folder: Path) -> dict[str, Any]:
    """A version's privacy report from its manifest (``nimmer versions show``): each guarantee,
    delta, the epsilons, the A.1 mechanism (N, q, expected cohort, z, C, T, accountant, sampling)
    and the audit's empirical lower bound."""
    from nimmer_train.artifacts import MANIFEST

    privacy = json.loads((folder / MANIFEST).read_text()).get("privacy", {})
    keys = (
        "guarantees",
        "delta",
        "epsilon_a1_user_level",
        "epsilon_a2_record_level",
        "no_privacy",
        "a1_mechanism",
        "audit_epsilon_lower_bound",
        "audit",
        "canary_exposure",
    )
    return {k: privacy[k] for k in keys if k in privacy}
