"""The federation's settings have one source, the schema: Hydra composes its defaults, and the
Flower app's run-config table is generated from it (and a stale table is caught)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest
from flwr.common.config import flatten_dict

from nimmer_train.config.federated import SIMULATION_ONLY, FederatedConfig, LocalRecipeConfig, UserDPConfig
from nimmer_train.config.flower_app import APP_PYPROJECT, app_config_table, sync_app_config
from nimmer_train.errors import ConfigError
from pipelines.entry import precheck
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
    # as Flower reads the table: nested tables and dotted keys flattened to "group.key"
    deployed = FederatedConfig.from_run_config(flatten_dict(pyproject["tool"]["flwr"]["app"]["config"]))
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


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("federated.noise_multiplier=0.5", "federated.noise_multiplier"),  # the flat key of before the groups
        ("federated.user_dp.noise_multiplier=abc", "federated.user_dp.noise_multiplier"),
        ("federated.user_dp.noise_multiplier=0", "federated.user_dp.noise_multiplier"),
        ("federated.local_dp.grad_sample_mode=rows", "federated.local_dp.grad_sample_mode"),
        ("federated.simulation.faults=[boom@1.1]", "federated.simulation.faults"),
    ],
)
def test_a_wrong_group_key_or_value_fails_with_one_line(override: str, expected: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        precheck([override])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and expected in err


def test_a_group_reads_back_its_own_keys_and_refuses_a_wrong_type() -> None:
    settings = FederatedConfig(user_dp=UserDPConfig(noise_multiplier=0.3), local=LocalRecipeConfig(steps=4))
    fit = settings.fit_config()
    assert fit["user-dp.noise-multiplier"] == 0.3 and fit["local-dp.noise-multiplier"] == 1.0
    assert UserDPConfig.from_fit_config(fit) == settings.user_dp
    assert LocalRecipeConfig.from_fit_config(fit) == settings.local
    with pytest.raises(ConfigError, match="local.steps"):
        LocalRecipeConfig.from_fit_config({"local.steps": 2.5})
