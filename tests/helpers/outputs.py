"""Readers of what a pipeline run left under its workdir, shared by unit and e2e tests: the one
published folder of a stage, a run's register adapters, its trusted keyring; and the epsilon
Opacus's own accountant gives for a sequence of DP mechanisms."""

from __future__ import annotations

import json
from pathlib import Path

from opacus.accountants import RDPAccountant

from nimmer_train.loras.adapters import METADATA
from nimmer_train.publish.signing import Keyring


def only(folder: Path) -> Path:
    """The one published item in ``folder`` (hidden work folders are skipped)."""
    (item,) = [p for p in folder.iterdir() if not p.name.startswith(".")]
    return item


def base_dir(workdir: Path) -> Path:
    return only(workdir / "artifacts" / "base")


def synth_dir(workdir: Path) -> Path:
    return only(workdir / "artifacts" / "synth")


def adapters(workdir: Path) -> dict[str, Path]:
    """The register adapters a run trained, by register."""
    root = only(workdir / "artifacts/loras")
    return {
        json.loads((p / METADATA).read_text())["register"]: p
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith(".")  # beside them: evaluation.json
    }


def keyring(workdir: Path) -> Keyring:
    return Keyring.load(workdir / "keys" / "trusted")


def rdp_epsilon(steps: list[tuple[float, float]]) -> float:
    """Epsilon at delta=1e-5 for (noise multiplier, sample rate) steps, by Opacus's accountant."""
    accountant = RDPAccountant()
    for noise, rate in steps:
        accountant.step(noise_multiplier=noise, sample_rate=rate)
    return accountant.get_epsilon(delta=1e-5)
