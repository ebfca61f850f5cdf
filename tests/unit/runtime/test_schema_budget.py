"""Ring A's length budget (issue 22, item 2): bounded() sizes its caps by the tokenizer's density,
and SchemaMask closes a reply that runs out of tokens anyway. A tokenizer trained in the test."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonschema import validate

from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, render_reply, validate_reply
from nimmer_train.voice.structured import SchemaMask, bounded, chars_per_token, end_of_turn_ids

TEXTS = ["Citizen, we have recorded your presence at Gate Seven. Return to your corridor. " * 30] * 8


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return train_bpe(TEXTS, vocab_size=400, model_max_length=512)


@settings(max_examples=80, deadline=None)
@given(st.integers(20, 400), st.floats(1.0, 5.0))
def test_a_reply_at_the_caps_fits_the_budget_at_that_density(max_new_tokens: int, density: float) -> None:
    """The longest reply the caps admit, its strings at ``density`` characters per token and its
    fixed parts at one token per character, takes at most max_new_tokens with the end of turn."""
    schema = bounded(TURN_SCHEMA, max_new_tokens, density)
    longest = {n: "x" * p["maxLength"] for n, p in schema["properties"].items()}
    validate(longest, schema)
    validate(longest, TURN_SCHEMA)  # whatever the caps admit is a valid turn
    skeleton = len(render_reply({n: "" for n in longest}))
    strings = sum(len(v) for v in longest.values())
    if schema["properties"]["utterance"]["maxLength"] > 1:  # (below the skeleton's size: one character)
        assert skeleton + strings / density + 1 <= max_new_tokens


def test_caps_grow_with_the_tokenizer_density() -> None:
    one, dense = bounded(TURN_SCHEMA, 224, 1.0), bounded(TURN_SCHEMA, 224, 3.5)
    assert dense["properties"]["utterance"]["maxLength"] > 3 * one["properties"]["utterance"]["maxLength"]
    tight = bounded(TURN_SCHEMA, 40, 1.0)  # too tight for three strings: only the required one stays
    assert list(tight["properties"]) == ["utterance"]


def test_chars_per_token_measures_the_tokenizer(tokenizer) -> None:  # noqa: ANN001
    density = chars_per_token(tokenizer, ["Citizen, we have recorded your presence."])
    assert density > 2.0  # trained on such text: several characters per token
    assert chars_per_token(tokenizer, ["zq xj vk"]) < density


def _talk(tokenizer, schema: dict, budget: int) -> list[int]:  # noqa: ANN001
    """The reply under the mask of a model that would talk forever (its favourite token: " ")."""
    n_vocab, talk = len(tokenizer), tokenizer(" ", add_special_tokens=False)["input_ids"][0]
    mask = SchemaMask(tokenizer, schema, n_vocab, 0, max_new_tokens=budget)
    ids = torch.zeros((1, 0), dtype=torch.long)
    for _ in range(budget):
        scores = torch.zeros((1, n_vocab))
        scores[0, talk] = 10.0
        token = int(mask(ids, scores).argmax())
        ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
        if token in end_of_turn_ids(tokenizer):
            break
    return ids[0].tolist()


def test_schema_mask_closes_a_reply_that_runs_out_of_tokens(tokenizer) -> None:  # noqa: ANN001
    """A model that would talk forever inside the utterance, with caps far above its budget: the
    mask forces the close in time, and the reply ends with the end-of-turn token."""
    schema = dict(TURN_SCHEMA)  # no caps at all
    for budget in (20, 23, 40):  # the forced {"utterance": " alone takes 14 tokens here
        out = _talk(tokenizer, schema, budget)
        assert out[-1] in end_of_turn_ids(tokenizer) and len(out) <= budget
        text = tokenizer.decode(out, skip_special_tokens=True)
        reply = validate_reply(text, TURN_SCHEMA)
        assert reply["utterance"] and render_reply(reply) == text


def test_a_reply_that_starts_another_property_late_still_closes(tokenizer) -> None:  # noqa: ANN001
    """Found in CI: a model that closed a string and began the next optional property a few
    tokens before its budget ran out stopped inside that key (`..., "gesture":`), which is not
    JSON. Random logits under the mask begin properties anywhere; every reply must still close."""
    n_vocab = len(tokenizer)
    eot = end_of_turn_ids(tokenizer)
    for seed in range(60):
        gen = torch.Generator().manual_seed(seed)
        budget = 24 + seed % 30
        mask = SchemaMask(tokenizer, dict(TURN_SCHEMA), n_vocab, 0, max_new_tokens=budget)
        ids = torch.zeros((1, 0), dtype=torch.long)
        for _ in range(budget):
            scores = mask(ids, torch.randn((1, n_vocab), generator=gen) * 4)
            token = int(torch.multinomial(scores.softmax(-1), 1, generator=gen))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in eot:
                break
        text = tokenizer.decode(ids[0].tolist(), skip_special_tokens=True)
        validate_reply(text, TURN_SCHEMA)  # raises on a reply left open


def test_a_reply_with_nothing_left_to_follow_uses_its_whole_budget(tokenizer) -> None:  # noqa: ANN001
    """Found in review: the close was kept back by what one more property costs even in the last
    property (nothing can follow it), so a one-property reply at 24 tokens said one character."""
    schema = {
        "type": "object",
        "properties": {"utterance": {"type": "string", "minLength": 1}},
        "required": ["utterance"],
        "additionalProperties": False,
    }
    for budget in (24, 32, 48):
        out = _talk(tokenizer, schema, budget)
        validate_reply(tokenizer.decode(out, skip_special_tokens=True), schema)
        assert budget - 4 <= len(out) <= budget  # closed at the last moment, not early
