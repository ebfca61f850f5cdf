"""Publish run alone takes the register adapters its config names (the fingerprints the lora
settings resolve to, or ``publish.adapters``), never whichever adapter on disk is newest; an
adapter the config names that is not there fails before any work, in one line."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from nimmer_train.errors import NimmerError
from nimmer_train.publish.stage import _loras
from tests.helpers.compose import config
from tests.helpers.outputs import adapters, base_dir
from tests.helpers.pipelines import run_pipeline


@pytest.fixture
def workdir(tiny_run: Path, tmp_path: Path) -> Path:
    """tiny_run's inputs and adapters, plus a newer adapter per register from another recipe
    (another fingerprint, as `-m lora.rank=4,8` leaves them)."""
    (tmp_path / "artifacts").mkdir()
    for inputs in ("corpus", "synth", "base"):
        (tmp_path / "artifacts" / inputs).symlink_to(tiny_run / "artifacts" / inputs)
    shutil.copytree(tiny_run / "artifacts/loras", tmp_path / "artifacts/loras", symlinks=True)
    later = time.time() + 60
    for register, folder in adapters(tmp_path).items():
        other = shutil.copytree(folder, folder.parent / f"{register}-000000000000")
        os.utime(other, (later, later))
    return tmp_path


def _newer(workdir: Path) -> list[Path]:
    return sorted(p for p in base_dir(workdir).parent.parent.glob("loras/*/*-000000000000"))


def test_publish_takes_the_adapters_the_lora_settings_name(tiny_run: Path, workdir: Path) -> None:
    cfg = config("experiment=ci_tiny", f"paths.workdir={workdir}")
    named = _loras(cfg, base_dir(workdir), None)
    trained = adapters(tiny_run)  # what train_loras made with these settings
    assert [p.name for p in named] == [trained[r].name for r in cfg.lora.registers]
    assert not set(named) & set(_newer(workdir))


def test_publish_takes_the_adapters_publish_adapters_lists(workdir: Path) -> None:
    newer = _newer(workdir)
    listed = ",".join(str(p) for p in newer)
    cfg = config("experiment=ci_tiny", f"paths.workdir={workdir}", f"publish.adapters=[{listed}]")
    assert _loras(cfg, base_dir(workdir), None) == newer


def test_publish_fails_naming_an_adapter_the_config_names_that_is_missing(workdir: Path) -> None:
    cfg = config("experiment=ci_tiny", f"paths.workdir={workdir}", "lora.rank=4")
    with pytest.raises(NimmerError, match="no trained adapter for hivemind-broadcast .*drunk-scavenger"):
        _loras(cfg, base_dir(workdir), None)

    base = f"publish.base_dir={base_dir(workdir)}"
    proc = run_pipeline("publish", workdir, "experiment=ci_tiny", base, "lora.rank=4", check=False)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: no trained adapter for hivemind-broadcast") and "train_loras" in last
    assert not (workdir / "releases").exists()  # nothing published, no key made
