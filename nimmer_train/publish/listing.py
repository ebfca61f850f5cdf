"""The registry's versions as a table: ``nimmer versions list`` and the end of publish/run_all."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

A1, A2 = "epsilon_a1_user_level", "epsilon_a2_record_level"


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
                    _epsilon(report.get("epsilon_a1_user_level"), report, A1),
                    _epsilon(a2, report, A2),
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


def _epsilon(value: float | None, report: dict[str, Any], key: str) -> str:
    """An epsilon (``report[key]``) for the table: the figure, with its caveat's label where it
    bounds nothing ("11112.345 (NO MEANINGFUL GUARANTEE)"), "none" where a mechanism ran without
    noise (no guarantee), "-" where no player data went in."""
    if value is not None:
        said = privacy_caveats(report).get(key)
        return f"{value:.3f}" + (f" ({caveat_label(said)})" if said else "")
    return "none" if report.get("no_privacy") else "-"


def privacy_caveats(privacy: dict[str, Any]) -> dict[str, str]:
    """{epsilon key: caveat} of a manifest's privacy block or a federation's metadata: the
    ``caveats`` the federation recorded (:func:`nimmer_train.federation.results.caveats`, the one
    home of the wording: an epsilon above ``results.MEANINGFUL_EPSILON`` bounds nothing); for a
    block written before caveats were recorded, the same function on its epsilons."""
    if "caveats" in privacy:
        return dict(privacy["caveats"] or {})
    eps = {key: privacy.get(key) for key in (A1, A2)}
    if privacy.get("no_privacy") or all(v is None for v in eps.values()):
        return {}
    from nimmer_train.federation.results import caveats  # heavy: only for such an old block

    return caveats({key.removeprefix("epsilon_"): value for key, value in eps.items()})


def caveat_label(caveat: str) -> str:
    """A caveat's short label for a table cell or a figure: its words before the first colon
    ("NO MEANINGFUL GUARANTEE")."""
    return caveat.split(":", 1)[0]


def privacy_report(folder: Path) -> dict[str, Any]:
    """A version's privacy report from its manifest (``nimmer versions show``): each guarantee,
    delta, the epsilons with the caveats of those that bound nothing, the A.1 mechanism (N, q,
    expected cohort, z, C, T, accountant, sampling) and the audit's empirical lower bound."""
    from nimmer_train.artifacts import MANIFEST

    privacy = json.loads((folder / MANIFEST).read_text()).get("privacy", {})
    keys = (
        "guarantees",
        "delta",
        "epsilon_a1_user_level",
        "epsilon_a2_record_level",
        "caveats",
        "no_privacy",
        "a1_mechanism",
        "audit_epsilon_lower_bound",
        "audit",
        "canary_exposure",
    )
    report = {k: privacy[k] for k in keys if k in privacy}
    if privacy:
        report["caveats"] = privacy_caveats(privacy)  # also for a manifest from before they were kept
    return report
