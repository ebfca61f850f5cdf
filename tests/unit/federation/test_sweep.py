"""The privacy-utility sweep (issue 14, item 4) on a tiny release: each cell's noise is
calibrated to its epsilon over the same N, q and T, each cell runs several seeds (the cells of one
N and seed share their cohorts), a run's share is taken against the non-private run of the same N
and seed and a cell reports the mean and spread, a rerun resumes per (cell, seed) instead of
spending again, and a sweep that cannot run fails on its config key."""

from __future__ import annotations

import json
import math
import shutil
import statistics
import warnings
from pathlib import Path

import pytest

from nimmer_train.config.federated import (
    FederatedConfig,
    LocalRecipeConfig,
    PrivacySweepConfig,
    SimulationConfig,
    UserDPConfig,
)
from nimmer_train.errors import ConfigError
from nimmer_train.federation.budget import mechanism_of
from nimmer_train.federation.population import SketchEmbedder
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

RECIPE = FederatedConfig(
    heldout_examples=8,
    user_dp=UserDPConfig(clipping_norm=1.0),
    local=LocalRecipeConfig(lr=1.0, steps=1),
    simulation=SimulationConfig(entries_per_player=16),
)
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
    assert settings.user_dp.fraction_fit == pytest.approx(5 / 40) and settings.nodes() == 40
    spent = mechanism_of(settings).epsilon()
    assert spent is not None and 7.9 < spent <= 8.0 and private["epsilon_spent"] == pytest.approx(spent)
    # each seed's share against the non-private run of the same seed, net of a noise-only gain
    # (test_sweep_power.py); the cell: their mean and spread
    shares = [
        (p["gain"] - max(p["noise_only_gain"], 0.0)) / o["gain"]
        for p, o in zip(private["runs"], open_["runs"], strict=True)
    ]
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


def _run(epsilon: float | None, seed: int, gain: float) -> dict:
    return {
        "epsilon": epsilon, "population": 40, "seed": seed, "sample_rate": 0.125, "expected_cohort": 5.0,
        "noise_multiplier": 0.0 if epsilon is None else 0.5, "noise_std_over_clip": 0.1, "rounds": 2,
        "delta": 1e-6, "epsilon_spent": epsilon, "heldout_loss_before": 6.0,
        "heldout_loss_after": 6.0 - gain, "gain": gain, "seconds": 1.0,
    }  # fmt: skip


def test_the_table_counts_only_the_seeds_a_share_was_taken_over() -> None:
    """Seed 0's non-private gain is negative: that seed has no share, so the cell's mean share
    (and the goal verdict) rests on seed 1 alone; the table says so (it said "mean of 2 seeds")."""
    runs = [_run(8.0, 0, 0.05), _run(None, 0, -0.01), _run(8.0, 1, 0.02), _run(None, 1, 0.04)]
    rows = summarise(runs)
    private = rows[0]
    assert [r["share"] for r in private["runs"]] == [None, 0.5]
    assert private["seeds"] == 2 and private["share_seeds"] == 1
    sweep = PrivacySweepConfig(epsilons=[8.0, float("inf")], populations=[40], cohort=5, goal_cells=["8@40"])
    text = table(rows, sweep)
    line = next(x for x in text.splitlines() if x.startswith("| 8 |"))
    assert "mean of 2 seeds" not in line
    assert "(goal 90 % NOT met, mean of 1 seed, 1 seed without a share (non-private gain <= 0))" in line
    # the non-private row: the same seed dropped; a cell with no share at all says why
    line = next(x for x in text.splitlines() if x.startswith("| inf"))
    assert "mean of 1 seed, 1 seed without a share" in line
    none = summarise([_run(8.0, 0, 0.05), _run(None, 0, -0.01)])
    assert "| — (1 seed without a share (non-private gain <= 0)) |" in table(none, sweep)


def test_the_documented_overrides_compose() -> None:
    """pipelines/privacy_sweep.py's docstring showed ``privacy_sweep.epsilons=[3,8,.inf]``, which
    fails to compose; the overrides it shows now compose, ``inf`` the non-private cell."""
    import re

    import pipelines.privacy_sweep
    from tests.helpers.compose import config

    shown = re.findall(r"'(privacy_sweep\.[^']+)'", pipelines.privacy_sweep.__doc__ or "")
    assert any(s.startswith("privacy_sweep.epsilons=") for s in shown), shown
    sweep = config(*shown).privacy_sweep
    assert sweep.epsilons[:2] == [3.0, 8.0] and math.isinf(sweep.epsilons[2])
    assert sweep.populations == [1000, 10000]


def _sweep_overrides(adapter: Path) -> list[str]:
    return [
        "experiment=ci_tiny", f"federated.adapter_dir={adapter}", "federated.user_dp.clipping_norm=1.0",
        "federated.local.lr=1.0", "federated.local.steps=1", "federated.simulation.entries_per_player=16",
        "federated.heldout_examples=8", "privacy_sweep.populations=[12]", "privacy_sweep.epsilons=[8,inf]",
        "privacy_sweep.rounds=1", "privacy_sweep.cohort=3", "privacy_sweep.goal_cells=[8@12]",
    ]  # fmt: skip


def test_a_sweep_on_another_base_gets_its_own_folder(tmp_path: Path) -> None:
    """The output folder's fingerprint covered the adapter's manifest fingerprint, the federated
    group and the sweep, but not the base: a rerun on another base (``lora.base_dir``) in the same
    workdir read the first base's result.json files and reported their losses as its own. It now
    covers the base's and the adapter's content (each file's sha256: both bases here carry the
    same manifest fingerprint, "test")."""
    import torch

    from nimmer_train.federation.sweep import sweep_stage
    from tests.helpers.compose import config

    warnings.filterwarnings("ignore")

    def perturb(model, _tokenizer) -> None:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))

    base1, adapter, _ = tiny_release(tmp_path / "r1")
    base2, _, _ = tiny_release(tmp_path / "r2", prepare=perturb)
    common = [*_sweep_overrides(adapter), "privacy_sweep.seeds=1", "tracking.enabled=false"]
    wd, fresh = f"paths.workdir={tmp_path / 'wd'}", f"paths.workdir={tmp_path / 'fresh'}"
    alone = sweep_stage(config(*common, fresh, f"lora.base_dir={base2}"))  # base 2 on its own
    first = sweep_stage(config(*common, wd, f"lora.base_dir={base1}"))
    assert alone[0]["heldout_loss_before"] != pytest.approx(first[0]["heldout_loss_before"])  # bases differ
    second = sweep_stage(config(*common, wd, f"lora.base_dir={base2}"))
    assert second[0]["heldout_loss_before"] == pytest.approx(alone[0]["heldout_loss_before"])
    assert len(list((tmp_path / "wd" / "privacy_sweep").glob("*/eps8-N12"))) == 2
    # the same base under another path is the same content: its finished runs are reused
    copy = tmp_path / "copy" / "tiny-release"
    shutil.copytree(base1, copy)
    again = sweep_stage(config(*common, wd, f"lora.base_dir={copy}"))
    assert [r["heldout_loss_after"] for r in again] == [r["heldout_loss_after"] for r in first]
    assert len(list((tmp_path / "wd" / "privacy_sweep").glob("*/eps8-N12"))) == 2


def test_a_rerun_with_other_seeds_records_what_it_ran_with(tmp_path: Path) -> None:
    """The fingerprint leaves out seeds and goal_share (more seeds extend a sweep), so a rerun with
    seeds=2 goal_share=0.5 resumed the MLflow run of seeds=1 goal_share=0.9, whose params (MLflow
    keeps a param's first value) went on saying seeds=1 and 0.9 beside a table of 2 seeds judged at
    50 %. Such a rerun now starts a new MLflow run in the same folder (tagged with the run it
    extends), whose params say what it ran with; a rerun of the same config continues its run;
    ``privacy_utility.json`` records the seeds and goals its table was judged with."""
    import mlflow
    from mlflow import MlflowClient

    from nimmer_train.federation.sweep import sweep_stage
    from tests.helpers.compose import config

    warnings.filterwarnings("ignore")
    base, adapter, _ = tiny_release(tmp_path / "release")
    common = [
        *_sweep_overrides(adapter), f"paths.workdir={tmp_path / 'wd'}", f"lora.base_dir={base}",
        "tracking.enabled=true",
    ]  # fmt: skip
    sweep_stage(config(*common, "privacy_sweep.seeds=1"))
    (root,) = (tmp_path / "wd" / "privacy_sweep").iterdir()
    first_id = (root / "mlflow_run_id").read_text().strip()
    cfg = config(*common, "privacy_sweep.seeds=2", "privacy_sweep.goal_share=0.5")
    rows = sweep_stage(cfg)
    assert rows[0]["seeds"] == 2 and (root / "eps8-N12" / "seed0" / "result.json").exists()
    run_id = (root / "mlflow_run_id").read_text().strip()
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri())
    run = MlflowClient().get_run(run_id)
    assert run_id != first_id and run.data.tags["privacy_sweep.extends_run"] == first_id
    params = run.data.params
    assert params["privacy_sweep.seeds"] == "2" and params["privacy_sweep.goal_share"] == "0.5", params
    assert "share_eps8_N12" in run.data.metrics or rows[0]["share"] is None
    judged = json.loads((root / "privacy_utility.json").read_text())
    assert (judged["seeds"], judged["goal_share"], judged["goal_cells"]) == (2, 0.5, ["8@12"])
    # the same config again (a killed job's rerun): the same MLflow run continues
    sweep_stage(cfg)
    assert (root / "mlflow_run_id").read_text().strip() == run_id
    assert MlflowClient().get_run(run_id).data.tags.get("resumed") == "true"
