"""The registry's versions as a table: ``nimmer versions list`` and the end of publish/run_all."""

from __future__ import annotations

from pathlib import Path


def print_versions(releases: Path) -> None:
    """The registry's versions as a table (``nimmer versions list``)."""
    from nimmer_train.publish.registry import Registry

    registry = Registry.open(releases)
    try:
        aliases: dict[str, list[str]] = {}
        for alias, label in registry.aliases().items():
            aliases.setdefault(label, []).append(alias)
        header = ("version", "released_at", "epsilon", "contributors", "loras", "parent", "mlflow", "aliases")
        rows = [header]
        parents = {v.id: v.label for v in registry.versions()}
        for v in registry.versions():
            r = v.row
            eps = r["differential_privacy_epsilon"]
            rows.append(
                (
                    v.label,
                    r["released_at"],
                    "-" if eps is None else f"{eps:.3f}",
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
