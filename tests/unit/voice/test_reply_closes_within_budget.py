"""A reply is schema-valid whatever its token budget (issue 39, found in CI: a quantized Ring A
turn cut mid-string, 'Unterminated string'): the grammar finishes a character cut after its first
byte, an empty required string or a key before it forces the close, and a budget below the
smallest valid reply is one clear error naming runtime.max_new_tokens and the minimum. Random
logits under the mask (a model that may say anything) on a tokenizer trained in the test."""

from __future__ import annotations

import pytest
import torch

from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, validate_reply
from nimmer_train.voice.sampling import SamplingKnobs, sample_rows, warp_rows
from nimmer_train.voice.structured import (
    BudgetTooSmall,
    RowGrammar,
    bounded,
    chars_per_token,
    end_of_turn_ids,
    smallest_reply_tokens,
)

# byte-level BPE with multi-byte characters in its corpus: tokens that end inside a character
TEXTS = ["Citizen, the gate — «closed» — wakes at dusk. Ärger über Wächter; 门 守 夜 🜁 " * 20] * 8


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return train_bpe(TEXTS, vocab_size=400, model_max_length=512)


def _reply(tokenizer, budget: int, seed: int) -> str:  # noqa: ANN001
    """One reply under the turn's grammar and knobs, decoded from random logits."""
    n_vocab, eot = len(tokenizer), end_of_turn_ids(tokenizer)
    knobs = SamplingKnobs(0.8, 0.9, 40, 1.1, 0.05, max_new_tokens=budget, no_repeat_ngram_size=3)
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    schema = bounded(TURN_SCHEMA, budget, chars_per_token(tokenizer), count)
    grammar, gen, ids = RowGrammar(tokenizer, schema, n_vocab, budget), torch.Generator(), []
    gen.manual_seed(seed)
    while len(ids) < budget:
        scores = torch.randn((1, n_vocab), generator=gen) * 3
        scores = scores.masked_fill(~grammar.allowed(len(ids), n_vocab)[None], float("-inf"))
        token = sample_rows(warp_rows(scores, [knobs], [ids]), [gen])[0]
        ids.append(token)
        grammar.consume(token)
        if token in eot:
            break
    return tokenizer.decode(ids, skip_special_tokens=True)


def test_every_reply_closes_at_tiny_budgets(tokenizer) -> None:  # noqa: ANN001
    minimum = smallest_reply_tokens(tokenizer, TURN_SCHEMA)
    assert minimum is not None
    for budget in range(minimum, minimum + 12):
        for seed in range(12):
            validate_reply(_reply(tokenizer, budget, seed), TURN_SCHEMA)  # raises on an open reply


def test_a_budget_below_the_smallest_reply_is_one_clear_error(tokenizer) -> None:  # noqa: ANN001
    minimum = smallest_reply_tokens(tokenizer, TURN_SCHEMA)
    assert minimum is not None
    with pytest.raises(BudgetTooSmall, match=rf"set runtime.max_new_tokens .* to at least {minimum}$"):
        RowGrammar(tokenizer, TURN_SCHEMA, len(tokenizer), minimum - 1)
