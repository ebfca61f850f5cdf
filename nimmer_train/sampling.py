"""Sampling knobs for one turn: temperature, top-p, top-k, repetition penalty, min-p."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from nimmer_train.registers import RegistersConfig


@dataclass(frozen=True)
class SamplingKnobs:
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    min_p: float
    max_new_tokens: int = 160

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def baseline(catalogue: RegistersConfig, register: str) -> SamplingKnobs:
    """A register's baseline from the design's scene-to-sampling table."""
    reg = catalogue.get(register)
    level = catalogue.variety[reg.sampling.variety]
    return SamplingKnobs(
        reg.sampling.temperature, reg.sampling.top_p, level.top_k, level.repetition_penalty, level.min_p
    )
