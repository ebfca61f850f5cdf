"""The privacy-utility table on the real base (issue 38 #4): ``experiment=privacy_real`` composes
to SmolLM2 with epsilon {3, 8, inf} at N = 10^4 and at least 2 seeds from a small fresh LoRA; that
start adapter is the base itself (B = 0) on the top layers only; and the non-private cell is the
same mechanism without noise: same N, q, clip, rounds, local recipe and cohorts, z = 0 (on a
tiny model: the suite never loads SmolLM2)."""

from __future__ import annotations

import dataclasses
import json
import math
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
from nimmer_train.federation.local_training import encode_rows, load_trainable
from nimmer_train.federation.population import SketchEmbedder
from nimmer_train.federation.start import fresh_start_adapter
from nimmer_train.federation.sweep import Cell, cell_settings, run_sweep
from nimmer_train.federation.wire import get_arrays
from nimmer_train.loras.adapters import load_base
from nimmer_train.loras.train import heldout_loss
from tests.helpers.compose import config
from tests.helpers.flower_deployment import tiny_release

SWEEP = PrivacySweepConfig(
    epsilons=[8.0, float("inf")],
    populations=[40],
    rounds=2,
    cohort=5,
    seeds=1,
    evaluate_every=1,
    goal_cells=["8@40"],
    control_cells=[],
)
RECIPE = FederatedConfig(
    start_rank=2,
    start_layers=1,
    heldout_examples=8,
    user_dp=UserDPConfig(clipping_norm=1.0),
    local=LocalRecipeConfig(lr=1.0, steps=1, batch_size=4),
    simulation=SimulationConfig(entries_per_player=16),
)


def test_the_real_base_sweep_composes_to_smollm2_at_n_10k_with_two_seeds() -> None:
    cfg = config("experiment=privacy_real")
    sweep = cfg.privacy_sweep
    assert cfg.model.name == "smollm2_135m"
    assert sweep.populations == [10_000] and sweep.seeds >= 2
    assert sweep.epsilons[:2] == [3.0, 8.0] and math.isinf(sweep.epsilons[2])
    assert cfg.federated.start_rank >= 1 and sweep.goal_cells == ["8@10000"] and sweep.evaluate_every == 1


def test_on_the_real_config_the_non_private_cell_differs_from_epsilon_8_only_in_its_noise() -> None:
    cfg = config("experiment=privacy_real")
    private = cell_settings(cfg.federated, cfg.privacy_sweep, Cell(8.0, 10_000))
    open_ = cell_settings(cfg.federated, cfg.privacy_sweep, Cell(float("inf"), 10_000))
    assert private.user_dp.noise_multiplier > 0 and open_.user_dp.noise_multiplier == 0

    def mechanism(settings: FederatedConfig) -> dict:
        out = dataclasses.asdict(settings)
        del out["user_dp"]["noise_multiplier"], out["no_privacy"]
        return out

    assert mechanism(private) == mechanism(open_)  # clip, q, N, rounds, local recipe: all the same


def test_the_fresh_start_is_the_base_itself_on_the_top_layers_only(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore")
    base, _, _ = tiny_release(tmp_path / "release")
    adapter = fresh_start_adapter(base, RECIPE, "caste-preacher", tmp_path / "sweep")
    assert fresh_start_adapter(base, RECIPE, "caste-preacher", tmp_path / "sweep") == adapter  # made once
    layers = json.loads((base / "config.json").read_text())["num_hidden_layers"]
    spec = json.loads((adapter / "adapter_config.json").read_text())
    assert spec["r"] == 2 and spec["layers_to_transform"] == [layers - 1]
    model, tokenizer = load_trainable(base, adapter)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names and all(f"layers.{layers - 1}." in n for n in names)
    rows = encode_rows(tokenizer, ["preacher-oran: Words scratched on the east gate."] * 3, 32)
    bare = load_base(base, "cpu").eval()
    assert heldout_loss(model.eval(), rows, tokenizer.pad_token_id) == pytest.approx(
        heldout_loss(bare, rows, tokenizer.pad_token_id), abs=1e-6
    )
    assert sum(a.size for a in get_arrays(model)) < 0.05 * sum(p.numel() for p in bare.parameters())


def test_the_non_private_run_sees_the_same_cohorts_and_rounds_without_noise(tmp_path: Path) -> None:
    warnings.filterwarnings("ignore")
    base, _, _ = tiny_release(tmp_path / "release")
    adapter = fresh_start_adapter(base, RECIPE, "caste-preacher", tmp_path / "sweep")
    root = tmp_path / "sweep"
    private, open_ = run_sweep(base, adapter, RECIPE, SWEEP, root, SketchEmbedder())
    assert open_["noise_multiplier"] == 0 and private["noise_multiplier"] > 0
    for key in ("population", "sample_rate", "expected_cohort", "rounds", "delta"):
        assert private[key] == open_[key], key

    def records(cell: str) -> list[dict]:
        return json.loads((root / cell / "seed0" / "simulation.json").read_text())["records"]

    mine, theirs = records("eps8-N40"), records("epsinf-N40")
    assert [r["sampled"] for r in mine] == [r["sampled"] for r in theirs]
    assert [r["accepted"] for r in mine] == [r["accepted"] for r in theirs]
    assert len(private["runs"][0]["curve"]) == SWEEP.rounds  # the curve, round by round
