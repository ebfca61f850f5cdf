"""This run's ratios beside the previous run's on the same machine, with the moves flagged.

A ratio moved when ``|now - before| / |before| > tolerance``; either direction is flagged (the
goal strings say which way is better). Runs of another machine (another CPU model, core count or
torch thread count) are never compared; smoke runs are never kept, so never compared either.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

TOLERANCE = 0.10


@dataclass(frozen=True)
class Row:
    benchmark: str
    ratio: str
    now: float | None
    before: float | None
    before_commit: str | None
    load: str = "-"  # the 1-minute load average during this run and the previous one

    def change(self) -> float | None:
        if self.now is None or self.before is None or self.before == 0:
            return None
        return (self.now - self.before) / abs(self.before)

    def moved(self, tolerance: float) -> bool:
        change = self.change()
        return change is not None and abs(change) > tolerance


def previous(runs: list[dict], current: dict) -> dict | None:
    """The latest kept run before ``current`` on the same machine (runs oldest first)."""
    key = current["machine"]["key"]
    earlier = [
        r
        for r in runs
        if r.get("run_id") != current["run_id"]
        and r.get("machine", {}).get("key") == key
        and not r.get("smoke")
        and r.get("started_at", "") <= current["started_at"]
    ]
    return earlier[-1] if earlier else None


def busiest(result: dict | None) -> str:
    """The highest 1-minute load average seen around a run, as text."""
    seen = [v for v in ((result or {}).get("load_average_1m") or {}).values() if v is not None]
    return f"{max(seen):.1f}" if seen else "-"


def rows(name: str, current: dict | None, before: dict | None) -> list[Row]:
    """One row per ratio of this run (and per ratio that only the previous run had)."""
    now = (current or {}).get("ratios", {})
    then = (before or {}).get("ratios", {})
    commit = before["commit"] if before else None
    load = f"{busiest(current)} / {busiest(before)}"
    keys = list(now) + [k for k in then if k not in now]
    if not keys:
        return [Row(name, "-", None, None, commit, load)]
    return [Row(name, k, now.get(k), then.get(k), commit, load) for k in keys]


def table(all_rows: list[Row], tolerance: float = TOLERANCE, failed: Collection[str] = ()) -> str:
    """A plain-text table: benchmark, ratio, now, previous (commit), change, load, flag."""

    def num(value: float | None) -> str:
        return "-" if value is None else f"{value:.4g}"

    header = ("benchmark", "ratio", "now", "previous", "prev. commit", "change", "load now/prev", "flag")
    lines = []
    for row in all_rows:
        change = row.change()
        if row.benchmark in failed:
            flag = "FAILED"
        elif row.moved(tolerance):
            flag = f"MOVED > {tolerance:.0%}"
        elif row.before is None:
            flag = "new" if row.now is not None else ""
        else:
            flag = ""
        lines.append(
            (
                row.benchmark,
                row.ratio,
                num(row.now),
                num(row.before),
                (row.before_commit or "-")[:12],
                "-" if change is None else f"{change:+.1%}",
                row.load,
                flag,
            )
        )
    widths = [max(len(str(c)) for c in col) for col in zip(header, *lines, strict=True)]
    fmt = "  ".join(f"{{:{w}}}" for w in widths)
    out = [fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    out += [fmt.format(*line) for line in lines]
    return "\n".join(s.rstrip() for s in out)
