"""The sentence guard reaches every engine an NPC turn runs on (issue 38): Ring A on the torch
engine and on llama.cpp, and ``nimmer serve``'s ``max_sentence_repeats`` field. Each model's
logits are overridden so that it can only bark one word (" gate", "!", or close the reply):
without the guard most replies say "gate!" three times or more, with it none does, on the
conftest's tiny published version (whose tokenizer has " gate" as one token, not "Ha")."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import openai

from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.quantized_model import QuantizedModel
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, validate_reply
from nimmer_train.voice.quality import repeats_sentence
from nimmer_train.voice.sampling import SamplingKnobs
from tests.helpers.forced_logits import forced_logits

MESSAGES = [
    {"role": "system", "content": '{"role":"a drunk scavenger"}'},
    {"role": "user", "content": "Did you find the coil?"},
]
KNOBS = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, max_new_tokens=160)
GUARDED = dataclasses.replace(KNOBS, max_sentence_repeats=2)
SEEDS = range(8)


def _favour(tokenizer: Any) -> dict[int, float]:
    """A barking model's next-token logits: " gate" and "!" alike, the string's close less (a
    reply ends now and then)."""
    (gate,), (bang,), (close,) = (
        tokenizer(t, add_special_tokens=False)["input_ids"] for t in (" gate", "!", '"')
    )
    return {gate: 5.0, bang: 5.0, close: 2.0}


class BarkingContext:
    """llama.cpp's context, its logits replaced by :func:`_favour` (prompt and KV still real)."""

    def __init__(self, context: Any, favour: dict[int, float]) -> None:
        self.context, self.favour = context, favour

    def _forced(self, logits: np.ndarray) -> np.ndarray:
        out = np.full_like(logits, -1e4)
        for token, value in self.favour.items():
            out[token] = value
        return out

    def prefill(self, prompt: list[int], register: str | None) -> np.ndarray:
        return self._forced(self.context.prefill(prompt, register))

    def step(self, token: int) -> np.ndarray:
        return self._forced(self.context.step(token))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.context, name)


def _repeating(speak: Any, knobs: SamplingKnobs) -> int:
    """How many of the seeded replies say one sentence more than twice."""
    utterances = [validate_reply(speak(knobs, seed), TURN_SCHEMA)["utterance"] for seed in SEEDS]
    assert sum(u.count("gate") for u in utterances) >= 3 * len(utterances)  # they do bark
    return sum(map(repeats_sentence, utterances))


def test_ring_a_on_the_torch_engine_never_says_a_sentence_three_times(model: LocalModel) -> None:
    name = model.registers[0]
    with forced_logits(model, _favour(model.tokenizer)):
        speak = lambda k, seed: model.generate(MESSAGES, name, k, TURN_SCHEMA, seed=seed).text  # noqa: E731
        assert _repeating(speak, KNOBS) >= len(SEEDS) // 2
        assert _repeating(speak, GUARDED) == 0


def test_ring_a_on_llama_cpp_never_says_a_sentence_three_times(published: tuple[Path, Path]) -> None:
    releases, trusted = published
    model = QuantizedModel.open(releases, "v1", trusted, "q8_0", threads=1)
    try:
        model.context = BarkingContext(model.context, _favour(model.tokenizer))
        name = model.registers[0]
        speak = lambda k, seed: model.generate(MESSAGES, name, k, TURN_SCHEMA, seed=seed).text  # noqa: E731
        assert _repeating(speak, KNOBS) >= len(SEEDS) // 2
        assert _repeating(speak, GUARDED) == 0
    finally:
        model.close()


def test_nimmer_serve_takes_max_sentence_repeats_as_ring_a_does(model: LocalModel, url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    name = model.registers[0]
    fmt = {"type": "json_schema", "json_schema": {"name": "turn", "schema": TURN_SCHEMA}}

    def speak(knobs: SamplingKnobs, seed: int) -> str:
        reply = client.chat.completions.create(
            model=f"{model.label}:{name}",
            messages=MESSAGES,
            max_tokens=knobs.max_new_tokens,
            seed=seed,
            temperature=knobs.temperature,
            response_format=fmt,  # type: ignore[arg-type]
            extra_body={"max_sentence_repeats": knobs.max_sentence_repeats},
        )
        return reply.choices[0].message.content or ""

    with forced_logits(model, _favour(model.tokenizer)):
        assert _repeating(speak, KNOBS) >= len(SEEDS) // 2
        assert _repeating(speak, GUARDED) == 0
        same = model.generate(MESSAGES, name, GUARDED, TURN_SCHEMA, seed=3).text
        assert json.loads(speak(GUARDED, 3)) == json.loads(same)  # the field reached the engine
