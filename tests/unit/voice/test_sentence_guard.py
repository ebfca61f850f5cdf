"""No sentence said more than ``max_sentence_repeats`` times in one reply (issue 38: the drunk
laughing "Ha! Ha! You missed a coil. Ha!", which the n-gram guard cannot see): the guard bans the
token that would end a third copy, at a mark, a JSON quote or the end of the reply, and nothing
else; decoded replies that favour repeating themselves never fail the voice bar's check under it,
and do without it. A byte-level BPE trained here; a decoder that prefers repeating itself."""

from __future__ import annotations

import pytest
import torch

from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, validate_reply
from nimmer_train.voice.quality import SENTENCE_END, repeats_sentence
from nimmer_train.voice.sampling import SamplingKnobs, sample_rows, warp_rows
from nimmer_train.voice.sentence_guard import BREAKS, SentenceGuard
from nimmer_train.voice.structured import RowGrammar, end_of_turn_ids

TEXTS = ['{"utterance": "Ha! Ha! You missed a coil, I forgot one. Ha ha. Halt... Hah?"}' * 10] * 8


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return train_bpe(TEXTS, vocab_size=400, model_max_length=512)


def _ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _enders(tokenizer, ids: list[int], limit: int = 2) -> set[str]:  # noqa: ANN001
    """The texts of the tokens banned after ``ids``, each token's text up to its first mark."""
    guard = SentenceGuard(tokenizer, end_of_turn_ids(tokenizer))
    return {tokenizer.decode([t]) for t in guard.reply(limit).bans(ids)}


def test_every_mark_of_the_voice_check_ends_a_sentence_for_the_guard() -> None:
    for mark in ".!?\u2026\n":
        assert SENTENCE_END.fullmatch(mark) and BREAKS.fullmatch(mark)
    assert BREAKS.fullmatch('"') and not SENTENCE_END.fullmatch('"')  # the JSON field's end too


def test_the_third_copy_cannot_end_and_nothing_else_is_banned(tokenizer) -> None:  # noqa: ANN001
    third = _enders(tokenizer, _ids(tokenizer, "Ha! Ha! You missed a coil. Ha"))
    ends = {tokenizer.decode([t]) for t in end_of_turn_ids(tokenizer)}
    assert {"!", ".", "?", '"'} | ends <= third  # any mark, or the end of the reply
    assert not any(any(c.isalpha() for c in t) for t in third - ends)
    assert _enders(tokenizer, _ids(tokenizer, "Ha! You missed a coil. Ha")) == set()  # said once
    assert _enders(tokenizer, _ids(tokenizer, "Ha! Ha! Ha ha")) == set()  # another sentence
    assert _enders(tokenizer, _ids(tokenizer, "Ha! Ha! Hal")) == set()
    assert _enders(tokenizer, _ids(tokenizer, "Ha! Ha! Ha ha"), limit=0) == set()
    case = _enders(tokenizer, _ids(tokenizer, "HA! ha... \u201cHa"))  # any case or punctuation inside
    assert "!" in case
    once = _enders(tokenizer, _ids(tokenizer, "Ha! Ha"), limit=1)
    assert "!" in once


def _reply(tokenizer, guard: SentenceGuard | None, seed: int, budget: int = 96) -> str:  # noqa: ANN001
    """A JSON reply from a decoder that would laugh "Ha! Ha! Ha! ..." and end after 24 tokens:
    after "Ha" it favours "!", after anything else " Ha", from the 24th token on the reply's close.
    (It ends before the budget does: a reply the budget closes mid-sentence keeps that sentence,
    the grammar wins over the guard as over the n-gram guard.)"""
    n_vocab, eot = len(tokenizer), end_of_turn_ids(tokenizer)
    ha, bang, space_ha = _ids(tokenizer, "Ha! Ha")
    close = _ids(tokenizer, 'Ha"}')[-1]
    knobs = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, max_new_tokens=budget, no_repeat_ngram_size=6)
    grammar, gen, ids = RowGrammar(tokenizer, TURN_SCHEMA, n_vocab, budget), torch.Generator(), []
    sentences = guard.reply(2) if guard else None
    gen.manual_seed(seed)
    while len(ids) < budget:
        scores = torch.randn((1, n_vocab), generator=gen)
        scores[0, bang if ids and ids[-1] in (ha, space_ha) else space_ha] += 8.0
        scores[0, close] += 10.0 if len(ids) >= 24 else 0.0
        scores = scores.masked_fill(~grammar.allowed(len(ids), n_vocab)[None], float("-inf"))
        banned = [sentences.bans(ids)] if sentences else None
        token = sample_rows(warp_rows(scores, [knobs], [ids], banned), [gen])[0]
        ids.append(token)
        grammar.consume(token)
        if token in eot:
            break
    return validate_reply(tokenizer.decode(ids, skip_special_tokens=True), TURN_SCHEMA)["utterance"]


def test_a_decoder_that_repeats_itself_never_says_a_sentence_three_times(tokenizer) -> None:  # noqa: ANN001
    guard = SentenceGuard(tokenizer, end_of_turn_ids(tokenizer))
    unguarded = [_reply(tokenizer, None, seed) for seed in range(12)]
    assert sum(map(repeats_sentence, unguarded)) >= 9  # the 6-gram guard lets most through (11 of 12)
    guarded = [_reply(tokenizer, guard, seed) for seed in range(12)]
    assert not any(map(repeats_sentence, guarded)), guarded
    assert sum(u.count("Ha") for u in guarded) >= 3 * len(guarded)  # still says what it favours


def test_the_limit_is_checked_in_the_config_sent_to_ring_b_and_dropped_by_ring_c(tmp_path) -> None:  # noqa: ANN001
    """A limit nimmer serve would refuse (outside 0-64) fails the catalogue naming the key; every
    NPC turn carries the catalogue's limit, Ring B's request body names it (an extension, only
    when on) and a Ring C provider never gets it, the turn saying so."""
    import yaml

    from nimmer_train.config.providers import adapt
    from nimmer_train.errors import ConfigError
    from nimmer_train.voice.registers import CONF_DIR, load_catalogue
    from nimmer_train.voice.sampling import baseline, shape_knobs

    raw = yaml.safe_load((CONF_DIR / "v1.yaml").read_text())
    raw["variety"]["high"]["max_sentence_repeats"] = 65
    (tmp_path / "v1.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"registers\.variety\.high\.max_sentence_repeats.*\[0, 64\]"):
        load_catalogue(path=tmp_path / "v1.yaml")
    catalogue = load_catalogue()
    for name in catalogue.names:
        knobs = shape_knobs(catalogue, name).knobs
        assert knobs.max_sentence_repeats == 2 and knobs.as_dict()["max_sentence_repeats"] == 2
        assert "max_sentence_repeats_unsupported_dropped" in adapt(knobs, "anthropic")[1]
        assert baseline(catalogue, name).max_sentence_repeats == 0  # the teacher is never guarded
    assert "max_sentence_repeats" not in baseline(catalogue, "drunk-scavenger").as_dict()
