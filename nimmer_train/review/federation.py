"""What each federation spent in privacy and what it bought (notebook 03): the round records
(participants, dropouts, rejected updates, held-out loss, cumulative epsilon) against the budget,
the privacy audits published with each version (its signed manifest), and the privacy-utility
sweep and the audit runs or benchmark where they were run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
from mlflow.entities import Run

from nimmer_train.publish import signoff
from nimmer_train.publish.registry import REGISTRY_FILE
from nimmer_train.review.sources import Sources, artifact_json, artifact_text, runs
from nimmer_train.review.versions import registry

ROUNDS = "federation/rounds.json"
SWEEP = "privacy_sweep/privacy_utility.json"
SWEEP_TABLE = "privacy_sweep/privacy_utility.md"
BENCH_RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"  # `make bench` writes them
ROUND_COLUMNS = [
    "round",
    "sampled",
    "participants",
    "dropped",
    "rejected",
    "a1_contributions_noised",
    "accepted",
    "heldout_loss",
    "epsilon_a1_user_level",
    "epsilon_a2_record_level",
    "reason",
]


def rounds(src: Sources, run: Run) -> pd.DataFrame:
    """The federate run's round records (its ``federation/rounds.json``), one row per round;
    ``rejected`` counts the updates the server refused."""
    records = artifact_json(src, run, ROUNDS) or []
    frame = pd.DataFrame(records)
    if frame.empty:
        return pd.DataFrame(columns=ROUND_COLUMNS)
    if "rejected" in frame:  # runs before issue 43 published the exact node counts; none since
        frame["rejected"] = frame["rejected"].map(lambda r: len(r) if isinstance(r, list) else r)
    return frame[[c for c in ROUND_COLUMNS if c in frame]].set_index("round")


def budget(run: Run) -> dict[str, float | None]:
    """The run's epsilon budget (None: no budget), delta and noise multiplier, from its params."""

    def number(key: str) -> float | None:
        value = run.data.params.get(key)
        return None if value in (None, "None", "") else float(value)

    return {
        "epsilon_budget": number("federated.epsilon_budget"),
        "delta": number("federated.delta"),
        # the A.1 z: federated.user_dp.noise_multiplier (federated.noise_multiplier in runs before
        # issue 41 grouped the settings)
        "noise_multiplier": next(
            (
                number(k)
                for k in ("federated.user_dp.noise_multiplier", "federated.noise_multiplier")
                if k in run.data.params
            ),
            None,
        ),
    }


def privacy_utility(src: Sources) -> tuple[pd.DataFrame, str] | None:
    """The newest privacy-utility sweep's rows and its markdown table; None when none was run."""
    for run in runs(src, "privacy_sweep"):
        found: Any = artifact_json(src, run, SWEEP)
        if found:
            return pd.DataFrame(found["rows"]), artifact_text(src, run, SWEEP_TABLE) or ""
    return None


def audits(src: Sources, results: Path | None = None) -> pd.DataFrame | None:
    """The privacy audits' figures, None when none ran: runs whose stage names an audit in the
    store, else the audit benchmark's published result (``benchmarks/results/bench_audit.json``:
    empirical epsilon lower bounds against theory, canary exposure with and without DP)."""
    client = src.client()
    experiments = [e.experiment_id for e in client.search_experiments()]
    found = (
        client.search_runs(experiments, "tags.stage LIKE '%audit%'", max_results=100) if experiments else []
    )
    if found:
        return pd.DataFrame([{"run": r.info.run_name, **r.data.metrics} for r in found])
    path = (results or BENCH_RESULTS) / "bench_audit.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    figures = {**record["ratios"], **record["figures"]}
    rows = [{"figure": k, "value": v} for k, v in figures.items() if isinstance(v, int | float)]
    source = f"{path.name}, commit {record['commit'][:12]}, {record['started_at']}"
    return pd.DataFrame(rows).assign(source=source)


def release_audits(src: Sources) -> pd.DataFrame | None:
    """The audits each published version carries in its signed manifest (``privacy.audit``: A.1's
    one-run audit; ``privacy.canary_exposure``: A.2's canary exposure), one row per version and
    audit with its result and verdict (pass / fail / inconclusive, as the sign-off judges it);
    None when no version carries one (nothing published, or no player data)."""
    if not (src.releases / REGISTRY_FILE).exists():
        return None
    rows = []
    with registry(src) as reg:
        for v in reg.versions():
            manifest = signoff.read_release(v.folder)
            for goal in signoff.audit_goals(manifest):
                if goal.status != signoff.NOT_APPLICABLE:
                    rows.append(
                        {"version": v.label, "audit": goal.goal, "result": goal.value,
                         "verdict": goal.status, "evidence": goal.located(v.folder)}
                    )  # fmt: skip
    return pd.DataFrame(rows) if rows else None
