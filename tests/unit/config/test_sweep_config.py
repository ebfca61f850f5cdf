"""The Optuna search (conf/hparams_search/lora_gain.yaml) composes: the sweeper is Optuna's, it
maximises, and every key it searches is a key of the schema; a sweep on the command line,
Optuna's intervals included, is checked before any job starts like any override."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir

from nimmer_train.config import LoraConfig
from pipelines.entry import CONF_DIR, _sweep_free, precheck
from tests.helpers import REPO


def test_the_lora_gain_search_composes_over_schema_keys() -> None:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        cfg = compose(config_name="config", overrides=["+hparams_search=lora_gain"], return_hydra_config=True)
    sweeper = cfg.hydra.sweeper
    assert sweeper._target_.endswith("optuna_sweeper.OptunaSweeper")
    assert sweeper.direction == "maximize" and str(cfg.hydra.mode) == "RunMode.MULTIRUN"
    lora_keys = {f"lora.{f.name}" for f in dataclasses.fields(LoraConfig)}
    assert set(sweeper.params) == {"lora.rank", "lora.lr", "lora.max_steps"} <= lora_keys


def test_sweeps_are_checked_at_their_first_value() -> None:
    assert _sweep_free(["lora.rank=4,8", "lora.lr=tag(log, interval(0.0003, 0.003))"]) == [
        "lora.rank=4",
        "lora.lr=0.0003",
    ]
    assert _sweep_free(["lora.max_steps=int(interval(20, 120))", "lora.dropout=choice(0.1,0.2)"]) == [
        "lora.max_steps=20",
        "lora.dropout=0.1",
    ]


def test_a_bad_value_in_a_sweep_fails_before_any_job(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        precheck(["-m", "+hparams_search=lora_gain", "lora.rank=choice(0,8)"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == ["error: lora.rank: must be >= 1"]


def test_without_the_sweep_extra_the_search_says_what_to_install(tmp_path) -> None:
    """A machine without hydra-optuna-sweeper, made here by hiding the plugin from Hydra's scan of
    the ``hydra_plugins`` namespace (sitecustomize runs before the entry point)."""
    (tmp_path / "empty").mkdir()
    (tmp_path / "sitecustomize.py").write_text(
        "import os, hydra_plugins\n"
        "hydra_plugins.__path__ = [p for p in hydra_plugins.__path__\n"
        "    if not os.path.isdir(os.path.join(p, 'hydra_optuna_sweeper'))] + "
        f"[{str(tmp_path / 'empty')!r}]\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, "-m", "pipelines.train_loras", "-m", "+hparams_search=lora_gain"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "Could not find 'hydra/sweeper/optuna'" in line and "pip install -e '.[sweep]'" in line
