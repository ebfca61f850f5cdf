"""In-process decoding (issue 22, items 6 and 7): the repetition penalty counts generated tokens
only, never the prompt (the memory items and scene words an NPC should repeat), and generation
stops at the chat template's end-of-turn token. The runtime checks drive tiny_run's v1 with its
logits overridden by a forward hook, so that the outcome does not hang on what the tiny model
happens to prefer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.voice.sampling import SamplingKnobs, knob_processors
from tests.helpers.forced_logits import forced_logits

MESSAGES = [
    {"role": "system", "content": '{"role":"a drunk scavenger","zone_context":"the copper coil yard"}'},
    {"role": "user", "content": "Where did the copper coil go?"},
]


def test_the_penalty_skips_the_prompt_and_hits_generated_tokens() -> None:
    knobs = SamplingKnobs(1.0, 1.0, 0, repetition_penalty=2.0, min_p=0.0)
    prompt, generated = [5, 6, 7], [8]
    processors = knob_processors(knobs, prompt_len=len(prompt))
    scores = processors(torch.tensor([prompt + generated]), torch.full((1, 12), 3.0))
    assert scores[0, 5:8].tolist() == [3.0, 3.0, 3.0]  # prompt words: untouched
    assert scores[0, 8] == pytest.approx(1.5)  # a generated word: penalised
    assert scores[0, 9] == 3.0


@pytest.fixture(scope="module")
def tiny_model(tiny_run: Path) -> LocalModel:
    return LocalModel.open(tiny_run / "releases", "v1", tiny_run / "keys" / "trusted")


def _prompt_ids(model: LocalModel) -> list[int]:
    ids = model.tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, return_dict=True)
    return list(ids["input_ids"])


@pytest.mark.slow
@pytest.mark.parametrize(("knob_penalty", "config_penalty"), [(100.0, None), (1.0, 100.0)])
def test_ring_a_does_not_penalise_a_word_of_the_prompt(
    tiny_model: LocalModel, knob_penalty: float, config_penalty: float | None
) -> None:
    """The prompt's word against one it lacks, the prompt's a little likelier: with a strong
    penalty a decoder that counts the prompt would pick the other (4 / 100 < 9); this one keeps
    the prompt's word, also when the checkpoint's generation_config.json carries a penalty of its
    own while the turn's knob is neutral (generate() would apply the config's to the prompt)."""
    tiny_model.model.generation_config.repetition_penalty = config_penalty
    prompt = _prompt_ids(tiny_model)
    word = tiny_model.tokenizer(" copper", add_special_tokens=False)["input_ids"][-1]
    other = next(t for t in range(10, len(tiny_model.tokenizer)) if t not in prompt)
    assert word in prompt
    knobs = SamplingKnobs(0.05, 1.0, 0, repetition_penalty=knob_penalty, min_p=0.0, max_new_tokens=1)
    with forced_logits(tiny_model, {word: 10.0, other: 9.0}):
        out = tiny_model.generate(MESSAGES, tiny_model.registers[0], knobs, seed=3)
    tiny_model.model.generation_config.repetition_penalty = None
    assert out.completion_tokens == 1
    assert out.text == tiny_model.tokenizer.decode([word])


@pytest.mark.slow
def test_ring_a_stops_at_the_end_of_turn_token(tiny_model: LocalModel) -> None:
    im_end = tiny_model.tokenizer.convert_tokens_to_ids("<|im_end|>")
    knobs = SamplingKnobs(1.0, 1.0, 0, repetition_penalty=1.0, min_p=0.0, max_new_tokens=24)
    with forced_logits(tiny_model, {im_end: 10.0}):
        out = tiny_model.generate(MESSAGES, tiny_model.registers[0], knobs, seed=1)
    assert out.completion_tokens == 1 and out.text == ""  # stopped at once, not 24 tokens later
