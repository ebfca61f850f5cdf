"""Provider profiles and the tier x ring rules (design: "Ring C — bring-your-own-key", "Adapter-layer
engineering", "Tier x Ring matrix").

A profile is one row of the design's provider table: which sampling knobs the provider accepts,
its structured-output mode, whether it takes user LoRAs, its temperature range and context
limit, and which wire format (``backend``) speaks to it. Ring C adapts a turn's knobs through
:func:`adapt` (drop, clamp, emulate, each recorded as a warning). Adding a provider is adding a row.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from nimmer_train.errors import ConfigError
from nimmer_train.voice.sampling import GUARDS, KNOBS, SamplingKnobs

STRUCTURED = ("json_schema", "json_mode", "tool_call")


@dataclass(frozen=True)
class ProviderProfile:
    backend: str  # the wire format: openai_compatible (Chat Completions) or anthropic (Messages)
    knobs: tuple[str, ...]  # sampling knobs the provider accepts; the rest are dropped
    structured: str  # json_schema | json_mode | tool_call
    lora: bool  # user LoRAs served; False: the register is emulated by the projection prompt
    temperature: tuple[float, float]  # accepted range; a knob outside is clamped
    context_tokens: int | None  # the usual model's window; None: the model's own


# design table "Provider | Multi-LoRA | Per-turn sampling knobs | Structured output | Compat"
PROFILES: dict[str, ProviderProfile] = {
    # a generic OpenAI-compatible endpoint: only what Chat Completions guarantees
    "openai_compatible": ProviderProfile(
        "openai_compatible", ("temperature", "top_p"), "json_mode", False, (0.0, 2.0), None
    ),
    "openai": ProviderProfile(
        "openai_compatible", ("temperature", "top_p"), "json_mode", False, (0.0, 2.0), 128_000
    ),
    "anthropic": ProviderProfile(
        "anthropic", ("temperature", "top_k"), "tool_call", False, (0.0, 1.0), 200_000
    ),
    "openrouter": ProviderProfile(
        "openai_compatible",
        ("temperature", "top_p", "top_k", "repetition_penalty", "min_p"),
        "json_mode",
        False,
        (0.0, 2.0),
        None,
    ),
    "hf_endpoints": ProviderProfile("openai_compatible", KNOBS, "json_schema", True, (0.0, 2.0), None),
    "together": ProviderProfile("openai_compatible", KNOBS, "json_schema", True, (0.0, 2.0), None),
    "replicate": ProviderProfile("openai_compatible", KNOBS, "json_mode", True, (0.0, 2.0), None),
    "modal": ProviderProfile("openai_compatible", KNOBS, "json_schema", True, (0.0, 2.0), None),
}


def profile(provider: str) -> ProviderProfile:
    """The row for ``provider``; an unknown name fails naming the known ones."""
    if provider not in PROFILES:
        raise ConfigError("provider", f"unknown provider {provider!r}; known: {', '.join(PROFILES)}")
    return PROFILES[provider]


def config_warnings(provider: str) -> list[str]:
    """What a Ring C tier loses with ``provider``, known at config time (feature_compat_warnings)."""
    row = profile(provider)
    lost = [] if row.lora else ["multi_lora_emulated_via_prompt"]
    return [*lost, *(f"{k}_unsupported_dropped" for k in KNOBS if k not in row.knobs)]


def adapt(knobs: SamplingKnobs, provider: str) -> tuple[SamplingKnobs, list[str]]:
    """The knobs as ``provider`` can take them, and the warnings: unsupported knobs dropped (left
    as they are here, never sent), a temperature outside the provider's range clamped into it.

    Not part of shaping (:func:`nimmer_train.voice.sampling.shape_knobs`): Ring C applies it to
    the shaped knobs at the wire, because only the ring knows its provider (after routing), and the
    turn records the knobs as shaped, with what the wire lost as feature_compat_warnings."""
    row = profile(provider)
    warnings = config_warnings(provider)
    # no provider's API has the project's guards (the request bodies never send them)
    warnings += [f"{guard}_unsupported_dropped" for guard in GUARDS if getattr(knobs, guard)]
    low, high = row.temperature
    if not low <= knobs.temperature <= high:
        clamped = min(high, max(low, knobs.temperature))
        warnings.append(f"temperature_{knobs.temperature}_clamped_to_{clamped}")
        knobs = dataclasses.replace(knobs, temperature=clamped)
    return knobs, warnings


# --- tier x ring rules ---
HIVEMIND_PROVIDER = "anthropic_via_us"  # design schema: hivemind_tier_provider, fixed (diegetic)
HIVEMIND_KEY_ENV = "NIMMER_HIVEMIND_API_KEY"  # our key, never the player's
TIER_RINGS = {"casual": ("A", "B", "C"), "deep": ("B", "C"), "hivemind": ("C",)}
REGISTER_TIERS = {"hivemind-broadcast": "hivemind", "clasp-confession": "deep"}


def check_tier_ring(tier: str, ring: str) -> None:
    """Refuse a tier in a ring the design's Tier x Ring matrix does not allow (Theia never on A)."""
    allowed = TIER_RINGS.get(tier, ("A", "B", "C"))
    if ring not in allowed:
        why = "the Theia tier is too large for local hardware" if tier == "deep" else "fixed by the design"
        raise ConfigError(
            f"{tier}_tier_ring",
            f"ring {ring} is not allowed for the {tier} tier ({why}); allowed: {', '.join(allowed)}",
        )


def route(
    register: str, in_between: bool, tier: str, rings: dict[str, Any], has_memory: bool
) -> tuple[str, list[str]]:
    """The tier that speaks this turn, and the warnings of any conflict.

    The hivemind register always goes to the hivemind tier when configured. The clasp-confession
    register and in-between turns go to the deep tier when the request left the default
    (casual) tier and a deep tier is configured; but an in-between turn with memory on a local
    casual ring stays there, because clasp text may only be read on Ring A (issue 17 wins)."""
    wanted = REGISTER_TIERS.get(register)
    if in_between and wanted is None:
        wanted = "deep"
    if wanted == "hivemind" and "hivemind" in rings:
        return "hivemind", []
    if wanted != "deep" or tier != "casual" or "deep" not in rings:
        return tier, []
    local = getattr(rings.get(tier), "local", False) is True
    if in_between and has_memory and local:
        return tier, ["deep_tier_routing_refused_clasp_stays_on_ring_A"]
    return "deep", []
