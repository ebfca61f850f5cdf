"""The composition spec: registers x trait jitter x scenes x turn intents x zones -> requests.

Each :class:`GenerationRequest` carries its composition tags, the DSL prompt, the teacher-facing
messages (the trait projection, since a teacher carries no LoRA) and the register's baseline
sampling. The expansion is a pure function of the spec, the catalogue and the seed.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
from omegaconf import MISSING

from nimmer_train.artifacts import fingerprint
from nimmer_train.errors import ConfigError
from nimmer_train.voice.prompt_dsl import AffectState, MemoryScope, TurnPrompt, render_projection
from nimmer_train.voice.registers import RegistersConfig
from nimmer_train.voice.sampling import SamplingKnobs, baseline
from nimmer_train.voice.traits import TRAIT_AXES


@dataclass
class SceneSpec:
    name: str = MISSING
    situation: str = MISSING
    player_utterance: str = MISSING
    mood: str = "neutral"
    valence: float = 0.0
    arousal: float = 0.5
    memory: list[str] = field(default_factory=list)


@dataclass
class CompositionConfig:
    name: str = MISSING
    registers: list[str] | None = None  # null: every register in the catalogue
    jitter_samples: int = 2
    jitter_scale: float = 0.15
    scenes: list[SceneSpec] = field(default_factory=list)
    turn_intents: list[str] = field(default_factory=list)
    zone_contexts: list[str] = field(default_factory=list)
    per_register: int | None = None  # null: the whole product; else a seeded sample of it
    seed: int = 0

    def __post_init__(self) -> None:
        for key in ("scenes", "turn_intents", "zone_contexts"):
            if not getattr(self, key):
                raise ConfigError(f"composition.{key}", "needs at least one entry")
        if self.jitter_samples < 1:
            raise ConfigError("composition.jitter_samples", "must be >= 1")


@dataclass(frozen=True)
class GenerationRequest:
    register: str
    tags: dict[str, str | int]
    prompt: TurnPrompt
    messages: list[dict[str, str]]  # what the teacher sees
    sampling: SamplingKnobs
    key: str  # sha256 of messages + sampling: the replay and cache key


def request_key(messages: list[dict[str, str]], sampling: SamplingKnobs) -> str:
    return fingerprint({"messages": messages, "sampling": sampling.as_dict()})


def jittered(traits: dict[str, float], scale: float, rng: np.random.Generator) -> dict[str, float]:
    """The profile with Gaussian noise on every axis, clipped to [-1, 1], rounded to 2 places."""
    return {
        axis: round(float(np.clip(traits.get(axis, 0.0) + rng.normal(0, scale), -1, 1)), 2)
        for axis in TRAIT_AXES
    }


def expand(spec: CompositionConfig, catalogue: RegistersConfig) -> list[GenerationRequest]:
    """Every request the spec asks for, in a fixed order."""
    names = spec.registers if spec.registers is not None else catalogue.names
    requests: list[GenerationRequest] = []
    for r_index, name in enumerate(names):
        register = catalogue.get(name)
        knobs = baseline(catalogue, name)
        profiles = [
            jittered(register.traits, spec.jitter_scale, np.random.default_rng([spec.seed, r_index, j]))
            for j in range(spec.jitter_samples)
        ]
        combos = list(
            itertools.product(range(spec.jitter_samples), spec.scenes, spec.turn_intents, spec.zone_contexts)
        )
        if spec.per_register is not None and spec.per_register < len(combos):
            pick = np.random.default_rng([spec.seed, r_index]).choice(
                len(combos), spec.per_register, replace=False
            )
            combos = [combos[i] for i in sorted(pick)]
        for jitter, scene, intent, zone in combos:
            prompt = TurnPrompt(
                role=register.role,
                trait_vector=profiles[jitter],
                affect_state=AffectState(scene.mood, scene.valence, scene.arousal),
                memory_scope=MemoryScope(items=tuple(scene.memory)),
                turn_intent=intent,
                zone_context=f"{zone}; {scene.situation}",
                player_utterance=scene.player_utterance,
            )
            messages = render_projection(prompt, register)
            tags = {
                "register": name,
                "jitter": jitter,
                "scene": scene.name,
                "turn_intent": intent,
                "zone": zone,
            }
            requests.append(
                GenerationRequest(name, tags, prompt, messages, knobs, request_key(messages, knobs))
            )
    return requests
