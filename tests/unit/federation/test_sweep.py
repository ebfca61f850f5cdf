"""The privacy-utility sweep (issue 14, item 4) on a tiny release: each cell's noise is
calibrated to its epsilon over the same N, q and T, the cells of one N share their cohorts, the
share is taken against the non-private run of the same N, a rerun resumes instead of spending
again, and a sweep that cannot run fails on its config key."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import pytest

from nimmer_train.config.federated import FederatedConfig, PrivacySweepConfig
from nimmer_train.errors import ConfigError
from nimmer_train.federation.population import SketchEmbedder
from nimmer_train.federation.rounds import mechanism_of
from nimmer_train.federation.sweep import Cell, cell_settings, goal_met, plot, run_sweep, table
from tests.helpers.flower_deployment import tiny_release

RECIPE = FederatedConfig(clipping_norm=1.0, lr=1.0, local_steps=1, entries_per_player=16, heldout_examples=8)
CELLS = ("eps8-N40", "epsinf-N40")
SWEEP = PrivacySweepConfig(
    epsilons=[8.0, float("inf")], populations=[40], rounds=2, cohort=5, evaluate_every=0, goal_cells=["8@40"]
)


def test_a_sweep_runs_every_cell_once_and_reports_shares(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore")
    base, adapter, _ = tiny_release(tmp_path / "release")
    rows = run_sweep(base, adapter, RECIPE, SWEEP, tmp_path / "sweep", SketchEmbedder())
    private, open_ = rows
    assert private["epsilon"] == 8.0 and open_["epsilon"] is None and open_["noise_multiplier"] == 0.0
    settings = cell_settings(RECIPE, SWEEP, Cell(8.0, 40))
    assert settings.fraction_fit == pytest.approx(5 / 40) and settings.nodes() == 40
    spent = mechanism_of(settings).epsilon()
    assert spent is not None and 7.9 < spent <= 8.0 and private["epsilon_spent"] == pytest.approx(spent)
    assert private["share"] == pytest.approx(private["gain"] / open_["gain"]) and open_["share"] == 1.0
    cohorts = [
        [
            r["sampled"]
            for r in json.loads((tmp_path / "sweep" / c / "simulation.json").read_text())["records"]
        ]
        for c in ("eps8-N40", "epsinf-N40")
    ]
    assert cohorts[0] == cohorts[1]  # one seed per N: the cells of a row see the same cohorts
    text = table(rows, SWEEP)
    assert "inf (no DP)" in text and "goal" in text
    assert set(goal_met(rows, SWEEP)) == {"8@40"}
    plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"
    # a rerun reads the finished cells; a cell killed after its rounds resumes without re-running
    (tmp_path / "sweep" / "eps8-N40" / "result.json").unlink()
    state = (tmp_path / "sweep" / "eps8-N40" / "simulation.json").read_text()
    again = run_sweep(base, adapter, RECIPE, SWEEP, tmp_path / "sweep", SketchEmbedder())
    assert [r["gain"] for r in again] == [r["gain"] for r in rows]
    assert (
        json.loads((tmp_path / "sweep" / "eps8-N40" / "simulation.json").read_text())["records"]
        == (json.loads(state)["records"])
    )


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"cohort": 100, "populations": [50]}, "privacy_sweep.cohort"),
        ({"epsilons": [0.0]}, "privacy_sweep.epsilons"),
        ({"delta": 1.0}, "privacy_sweep.delta"),
    ],
)
def test_a_sweep_that_cannot_run_names_its_key(values: dict, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        PrivacySweepConfig(**values)
    assert math.isinf(PrivacySweepConfig().epsilons[-1])
