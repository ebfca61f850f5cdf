"""The register catalogue: the v1 register trait-LoRAs and everything each one carries.

``conf/registers/<version>.yaml`` is the single source; Hydra jobs receive it as
``cfg.registers`` and everything else (runtime, federated client) calls :func:`load_catalogue`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, OmegaConf

from nimmer_train.artifacts import REPO_ROOT
from nimmer_train.errors import ConfigError, NimmerError
from nimmer_train.voice.traits import check_vector

CONF_DIR = REPO_ROOT / "conf" / "registers"


@dataclass
class VarietyLevel:
    """What the design's qualitative variety level (very-low ... high) means as sampling knobs."""

    top_k: int = MISSING
    repetition_penalty: float = MISSING
    min_p: float = MISSING
    no_repeat_ngram_size: int = 0  # no n-gram of the reply's own tokens twice (0: off)
    # NPC turns only (the teacher is asked, and the replay set keyed, at repetition_penalty): the
    # penalty a turn starts from when the small speaker needs another than the teacher (None: the
    # same). SmolLM2 at temperature 0.2 loops on one frame a large teacher never did.
    turn_repetition_penalty: float | None = None
    # NPC turns only: no sentence said more than this many times in one reply (0: off; the voice
    # bar's limit is 2). voice/sentence_guard.py holds it while decoding.
    max_sentence_repeats: int = 0

    @property
    def turn_penalty(self) -> float:
        """The repetition penalty an NPC turn starts from."""
        return (
            self.repetition_penalty if self.turn_repetition_penalty is None else self.turn_repetition_penalty
        )


@dataclass
class BaselineSampling:
    """A register's baseline from the design's scene-to-sampling table."""

    temperature: float = MISSING
    top_p: float = MISSING
    variety: str = MISSING


@dataclass
class Register:
    role: str = MISSING  # the NPC role a prompt names ("a caste-preacher of the lower ring")
    description: str = MISSING
    register: str = MISSING  # register descriptors
    cadence: str = MISSING
    word_choice: list[str] = field(default_factory=list)
    traits: dict[str, float] = field(default_factory=dict)
    sampling: BaselineSampling = field(default_factory=BaselineSampling)
    literary_affinities: list[str] = field(default_factory=list)  # corpus work keys
    exemplars: list[str] = field(default_factory=list)  # reference lines in the register's voice


@dataclass
class RegistersConfig:
    version: str = MISSING
    variety: dict[str, VarietyLevel] = field(default_factory=dict)
    catalogue: dict[str, Register] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for level, knobs in self.variety.items():
            if not 0 <= knobs.no_repeat_ngram_size <= 64:  # nimmer serve's bound for the field
                raise ConfigError(
                    f"registers.variety.{level}.no_repeat_ngram_size",
                    f"must be an integer in [0, 64] (0: off), not {knobs.no_repeat_ngram_size}",
                )
            if not 0 <= knobs.max_sentence_repeats <= 64:  # nimmer serve's bound for the field
                raise ConfigError(
                    f"registers.variety.{level}.max_sentence_repeats",
                    f"must be an integer in [0, 64] (0: off), not {knobs.max_sentence_repeats}",
                )
            penalty = knobs.turn_repetition_penalty
            if penalty is not None and not 0 < penalty <= 10:  # nimmer serve's bound (nan fails too)
                raise ConfigError(
                    f"registers.variety.{level}.turn_repetition_penalty",
                    f"must be in (0, 10] (1: off) or null (the teacher's), not {penalty}",
                )
        if not 4 <= len(self.catalogue) <= 6:
            raise ConfigError("registers.catalogue", f"v1 has 4 to 6 registers, got {len(self.catalogue)}")
        for name, reg in self.catalogue.items():
            key = f"registers.catalogue.{name}"
            try:
                check_vector(reg.traits, f"{key}.traits")
            except ValueError as exc:
                raise ConfigError(f"{key}.traits", str(exc).split(": ", 1)[1]) from exc
            if reg.sampling.variety not in self.variety:
                raise ConfigError(
                    f"{key}.sampling.variety",
                    f"unknown level {reg.sampling.variety!r}; known: {', '.join(self.variety)}",
                )
            if len(reg.exemplars) < 3:
                raise ConfigError(f"{key}.exemplars", "needs at least 3 exemplar lines")

    @property
    def names(self) -> list[str]:
        return list(self.catalogue)

    def get(self, name: str) -> Register:
        """The register called ``name``; an unknown name fails with the known ones listed."""
        if name not in self.catalogue:
            raise NimmerError(
                f"unknown register {name!r}; known registers ({self.version}): {', '.join(self.catalogue)}"
            )
        return self.catalogue[name]


# VarietyLevel fields that only NPC turns read
TURN_ONLY = ("turn_repetition_penalty", "max_sentence_repeats")


def teachers_view(catalogue: RegistersConfig) -> dict[str, Any]:
    """The catalogue as the teacher and the training stages read it, for their fingerprints:
    without the fields only NPC turns read, so that tuning one renames no synthetic corpus and
    retrains nothing. (``no_repeat_ngram_size``, turn-only too, stays: the fingerprints have
    always held it, and dropping it would rebuild every existing workdir once.)"""
    out = dataclasses.asdict(catalogue)
    for level in out["variety"].values():
        for key in TURN_ONLY:
            del level[key]
    return out


def load_catalogue(version: str = "v1", path: Path | None = None) -> RegistersConfig:
    """Read and validate a catalogue outside Hydra (runtime, federated client, notebooks)."""
    source = path or CONF_DIR / f"{version}.yaml"
    if not source.exists():
        raise NimmerError(f"no register catalogue at {source}")
    merged = OmegaConf.merge(OmegaConf.structured(RegistersConfig), OmegaConf.load(source))
    catalogue = OmegaConf.to_object(merged)
    assert isinstance(catalogue, RegistersConfig)
    return catalogue
