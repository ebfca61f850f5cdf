"""The privacy-utility sweep (issue 14, item 4) on a tiny release: each cell's noise is
calibrated to its epsilon over the same N, q and T, each cell runs several seeds (the cells of one
N and seed share their cohorts), a run's share is taken against the non-private run of the same N
and seed and a cell reports the mean and spread, a rerun resumes per (cell, seed) instead of
spending again, and a sweep that cannot run fails on its config key."""

from __future__ import annotations

import json
import math
import statistics
import warnings
from pathlib import Path

import pytest

from nimmer_train.config.federated import FederatedConfig, PrivacySweepConfig
from nimmer_train.errors import ConfigError
from nimmer_train.federation.population import SketchEmbedder
from nimmer_train.federation.rounds import mechanism_of
from nimmer_train.federation.sweep import (
    Cell,
    cell_settings,
    goal_met,
    plot,
    run_sweep,
    summarise,
    table,
)
from tests.helpers.flower_deployment import tiny_release

RECIPE = FederatedConfig(clipping_norm=1.0, lr=1.0, local_steps=1, entries_per_player=16, heldout_examples=8)
SWEEP = PrivacySweepConfig(
    epsilons=[8.0, float("inf")],
    populations=[40],
    rounds=2,
    cohort=5,
    seeds=2,
    evaluate_every=0,
    goal_cells=["8@40"],
)


def _records(root: Path, cell: str, seed: int) -> list[dict]:
    return json.loads((root / cell / f"seed{seed}" / "simulation.json").read_text())["records"]


def test_a_sweep_runs_every_cell_and_seed_once_and_reports_mean_shares(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore")
    base, adapter, _ = tiny_release(tmp_path / "release")
    root = tmp_path / "sweep"
    rows = run_sweep(base, adapter, RECIPE, SWEEP, root, SketchEmbedder())
    private, open_ = rows
    assert private["epsilon"] == 8.0 and open_["epsilon"] is None and open_["noise_multiplier"] == 0.0
    assert private["seeds"] == open_["seeds"] == 2 and [r["seed"] for r in private["runs"]] == [0, 1]
    settings = cell_settings(RECIPE, SWEEP, Cell(8.0, 40))
    assert settings.fraction_fit == pytest.approx(5 / 40) and settings.nodes() == 40
    spent = mechanism_of(settings).epsilon()
    assert spent is not None and 7.9 < spent <= 8.0 and private["epsilon_spent"] == pytest.approx(spent)
    # each seed's share against the non-private run of the same seed; the cell: their mean and spread
    shares = [p["gain"] / o["gain"] for p, o in zip(private["runs"], open_["runs"], strict=True)]
    assert [r["share"] for r in private["runs"]] == pytest.approx(shares)
    assert private["share"] == pytest.approx(statistics.mean(shares))
    assert private["share_sd"] == pytest.approx(statistics.stdev(shares))
    assert (private["share_min"], private["share_max"]) == pytest.approx((min(shares), max(shares)))
    assert open_["share"] == 1.0 and open_["share_sd"] == 0.0
    assert private["gain"] == pytest.approx(statistics.mean(r["gain"] for r in private["runs"]))
    # one generator per (N, seed): a row's cells see the same cohorts, the seeds different ones
    cohorts = {
        (c, k): [r["sampled"] for r in _records(root, c, k)]
        for c in ("eps8-N40", "epsinf-N40")
        for k in (0, 1)
    }
    assert (
        cohorts["eps8-N40", 0] == cohorts["epsinf-N40", 0]
        and cohorts["eps8-N40", 1] == cohorts["epsinf-N40", 1]
    )
    assert _records(root, "epsinf-N40", 0) != _records(root, "epsinf-N40", 1)
    text = table(rows, SWEEP)
    assert "inf (no DP)" in text and "mean of 2 seeds" in text and "±" in text
    assert set(goal_met(rows, SWEEP)) == {"8@40"}
    plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun reads the finished runs; a run killed after its rounds resumes without re-running
    (root / "eps8-N40" / "seed1" / "result.json").unlink()
    state = _records(root, "eps8-N40", 1)
    again = run_sweep(base, adapter, RECIPE, SWEEP, root, SketchEmbedder())
    assert [r["gain"] for r in again] == [r["gain"] for r in rows]
    assert _records(root, "eps8-N40", 1) == state


def test_the_goal_is_judged_on_the_mean_share_and_says_how_many_seeds() -> None:
    def run(epsilon: float | None, seed: int, gain: float) -> dict:
        return {
            "epsilon": epsilon, "population": 1000, "seed": seed, "sample_rate": 0.1,
            "expected_cohort": 100.0, "noise_multiplier": 0.0 if epsilon is None else 0.5,
            "noise_std_over_clip": 0.005, "rounds": 10, "delta": 1e-6, "epsilon_spent": epsilon,
            "heldout_loss_before": 6.0, "heldout_loss_after": 6.0 - gain, "gain": gain, "seconds": 1.0,
        }  # fmt: skip

    # one lucky seed (100 %) and two poor ones: the mean, 80 %, misses the 90 % goal
    runs = [run(None, k, 0.2) for k in range(3)] + [run(8.0, 0, 0.2), run(8.0, 1, 0.14), run(8.0, 2, 0.14)]
    rows = summarise(runs)
    private = next(r for r in rows if r["epsilon"] == 8.0)
    assert private["share"] == pytest.approx(0.8) and private["share_max"] == pytest.approx(1.0)
    sweep = PrivacySweepConfig(populations=[1000], goal_cells=["8@1000"])
    assert goal_met(rows, sweep) == {"8@1000": False}
    assert "80.0 % ± 17.3 [70.0, 100.0] (goal 90 % NOT met, mean of 3 seeds)" in table(rows, sweep)
    # a seed whose non-private run gained nothing has no share; the others still count
    rows = summarise([*runs, run(None, 3, -0.1), run(8.0, 3, 0.1)])
    private = next(r for r in rows if r["epsilon"] == 8.0)
    assert private["seeds"] == 4 and private["share"] == pytest.approx(0.8)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"cohort": 100, "populations": [50]}, "privacy_sweep.cohort"),
        ({"epsilons": [0.0]}, "privacy_sweep.epsilons"),
        ({"delta": 1.0}, "privacy_sweep.delta"),
        ({"seeds": 0}, "privacy_sweep.seeds"),
    ],
)
def test_a_sweep_that_cannot_run_names_its_key(values: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PrivacySweepConfig(**values)
    assert math.isinf(PrivacySweepConfig().epsilons[-1])
