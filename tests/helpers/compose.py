"""Compose typed configs in tests exactly as the pipelines do (Hydra compose + schema)."""

from __future__ import annotations

from hydra import compose, initialize_config_dir

from nimmer_train.config import Config
from nimmer_train.voice.composition import CompositionConfig
from pipelines.entry import CONF_DIR, _to_config


def config(*overrides: str) -> Config:
    with initialize_config_dir(config_dir=CONF_DIR, version_base="1.3"):
        return _to_config(compose(config_name="config", overrides=list(overrides)))


def composition(*overrides: str) -> CompositionConfig:
    return config(*overrides).composition
