"""The federation's settings have one source, the schema: Hydra composes its defaults, and the
Flower app's run-config table is generated from it (and a stale table is caught)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

from nimmer_train.config.federated import SIMULATION_ONLY, FederatedConfig
from nimmer_train.config.flower_app import APP_PYPROJECT, app_config_table, sync_app_config
from tests.helpers import REPO
from tests.helpers.compose import config


def test_run_config_mirrors_the_hydra_defaults() -> None:
    assert not (REPO / "conf/federated").exists(), "the federated defaults live only in the schema"
    assert config().federated == FederatedConfig()
    assert APP_PYPROJECT == REPO / "federated/pyproject.toml"
    assert sync_app_config(), (
        "federated/pyproject.toml is stale: run python -m nimmer_train.config.flower_app --write"
    )
    pyproject = tomllib.loads(APP_PYPROJECT.read_text())
    deployed = FederatedConfig.from_run_config(pyproject["tool"]["flwr"]["app"]["config"])
    assert FederatedConfig.from_run_config(FederatedConfig().to_run_config()) == FederatedConfig()
    for name in FederatedConfig.__dataclass_fields__:
        if name not in SIMULATION_ONLY:
            assert getattr(deployed, name) == getattr(FederatedConfig(), name), name


def test_a_stale_app_table_is_caught_and_rewritten(tmp_path: Path) -> None:
    copy = tmp_path / "pyproject.toml"
    shutil.copy(APP_PYPROJECT, copy)
    copy.write_text(copy.read_text().replace("\nrounds = 2\n", "\nrounds = 7\n"))
    assert not sync_app_config(copy)
    assert sync_app_config(copy, write=True)
    assert sync_app_config(copy)
    assert app_config_table() in copy.read_text()
    assert copy.read_text().startswith(APP_PYPROJECT.read_text().split("[tool.flwr.app.config]")[0])
