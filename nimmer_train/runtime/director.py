"""Per-turn director overrides of the sampling knobs (design: "Runtime sampling knobs": temperature,
top-P, top-K, repetition-penalty "as per-turn director-controlled levers").

A turn request may set any sampling knob, within its register's bounds: the register's baseline
from the scene-to-sampling table, temperature +-0.3 and top-p +-0.15, and top-k, repetition
penalty and min-p within the span of the register's variety level and its neighbours on the
catalogue's variety ladder. The director shades a register's voice; it cannot make the hivemind
sound like a drunk scavenger. A value outside the bounds is refused, naming knob, value and bounds.
"""

from __future__ import annotations

import dataclasses

from nimmer_train.errors import NimmerError
from nimmer_train.voice.registers import RegistersConfig
from nimmer_train.voice.sampling import SamplingKnobs, baseline

KNOBS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")
TEMPERATURE_SPAN, TOP_P_SPAN = 0.3, 0.15


def bounds(catalogue: RegistersConfig, register: str) -> dict[str, tuple[float, float]]:
    """The (low, high) each knob may take for ``register``."""
    base = baseline(catalogue, register)
    ladder = sorted(catalogue.variety, key=lambda level: catalogue.variety[level].top_k)
    i = ladder.index(catalogue.get(register).sampling.variety)
    near = [catalogue.variety[level] for level in ladder[max(0, i - 1) : i + 2]]
    span = {k: (min(getattr(v, k) for v in near), max(getattr(v, k) for v in near)) for k in KNOBS[2:]}
    return {
        "temperature": (
            max(0.05, base.temperature - TEMPERATURE_SPAN),
            min(2.0, base.temperature + TEMPERATURE_SPAN),
        ),
        "top_p": (max(0.1, base.top_p - TOP_P_SPAN), min(1.0, base.top_p + TOP_P_SPAN)),
        **span,
    }


def direct(
    catalogue: RegistersConfig, register: str, knobs: SamplingKnobs, overrides: dict[str, float] | None
) -> tuple[SamplingKnobs, dict[str, dict[str, float]]]:
    """``knobs`` with the director's ``overrides`` applied, and the record for the turn's log
    (``{knob: {"from": old, "to": new}}``). Unknown knobs and values out of bounds are refused."""
    if not overrides:
        return knobs, {}
    limits = bounds(catalogue, register)
    record: dict[str, dict[str, float]] = {}
    for knob, value in overrides.items():
        if knob not in KNOBS:
            raise NimmerError(f"director override {knob!r}: not a sampling knob; known: {', '.join(KNOBS)}")
        low, high = limits[knob]
        if not isinstance(value, int | float) or not low - 1e-9 <= value <= high + 1e-9:
            raise NimmerError(
                f"director override {knob}={value!r} is outside register {register!r}'s bounds "
                f"[{low:g}, {high:g}]; choose a value inside them or another register"
            )
        record[knob] = {"from": getattr(knobs, knob), "to": value}
    typed = {k: int(v) if k == "top_k" else float(v) for k, v in overrides.items()}
    return dataclasses.replace(knobs, **typed), record
