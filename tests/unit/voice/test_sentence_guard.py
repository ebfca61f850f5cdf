"""No sentence said more than ``max_sentence_repeats`` times in one reply (issue 38: the drunk
laughing "Ha! Ha! You missed a coil. Ha!", which the n-gram guard cannot see): the guard bans the
token that would end a third copy, and nothing else, reading the reply as the voice check reads
the utterance (JSON escapes decoded, quotes and braces inside it plain characters, keys and other
fields apart, a character split over byte tokens read whole, a combining accent joined to its
letter); decoded replies that favour repeating themselves never fail the check under it, and do
without it. Byte-level BPEs trained here; a decoder that prefers repeating itself.

Three adversarial reviews found each case below let through (or banned wrongly) by an earlier
guard; each is a test here, in the order they were found."""

from __future__ import annotations

import pytest
import torch

from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, validate_reply
from nimmer_train.voice.quality import repeats_sentence
from nimmer_train.voice.sampling import SamplingKnobs, sample_rows, warp_rows
from nimmer_train.voice.sentence_guard import SentenceGuard
from nimmer_train.voice.structured import RowGrammar, end_of_turn_ids

LINE = '{"utterance": "Ha! Ha! You missed a coil, I forgot one. Ha ha. Halt... Hah?\\nHalt"}'
TEXTS = [LINE * 10] * 8
QUOTED = ['He said "go". She said "no"! They asked "why"? ' * 20] * 8  # '".' '"!' '"?' as tokens
# ". then a curly quote or dash": ".\xe2\x80" merges before any whole character does
MARK_THEN_LEAD = ['{"utterance": "Ha.\u201c Ha.\u201d Ha.\u2018 Ha.\u2019 Ha.\u2014 Ha! Ha"}' * 20] * 8
# four characters ending in byte 0x9d, each before ".": "\x9d." merges before any of them
TAIL_THEN_MARK = ['{"utterance": "Ha\u201d. Ha\u221d. Ha\u2e1d. Ha\u205d. Ha! Ha"}' * 20] * 8
AU = "\u0b92\u0bd7"  # Tamil letter O, then the AU length mark (a spacing mark, combining class 0)
TAMIL = ['{"utterance": "' + (AU + "! ") * 20 + AU + '."}'] * 8
ACCENTED = ['{"utterance": "Ha! Ha! You missed a coil. Cafe\u0301! Cafe\u0301? Halt... Hah?"}' * 10] * 8


def _bpe(texts: list[str]):  # noqa: ANN202
    return train_bpe(texts, vocab_size=400, model_max_length=512)


@pytest.fixture(scope="module")
def tokenizer():  # noqa: ANN201
    return _bpe(TEXTS)


def _one(tokenizer, text: str) -> int:  # noqa: ANN001
    """The single token whose text is ``text``."""
    ids = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) == text]
    assert ids, f"no token {text!r}"
    return ids[0]


def _ids(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _bans(tokenizer, text: str, limit: int = 2, structured: bool = False) -> set[str]:  # noqa: ANN001
    """The texts of the tokens banned after ``text``."""
    guard = SentenceGuard(tokenizer, end_of_turn_ids(tokenizer))
    return {tokenizer.decode([t]) for t in guard.reply(limit, structured).bans(_ids(tokenizer, text))}


def test_the_third_copy_cannot_end_and_nothing_else_is_banned(tokenizer) -> None:  # noqa: ANN001
    ends = {tokenizer.decode([t]) for t in end_of_turn_ids(tokenizer)}
    free = _bans(tokenizer, "Ha! Ha! You missed a coil. Ha")
    assert {"!", ".", "?"} | ends <= free and '"' not in free  # any mark, or the end of the reply
    assert not any(any(c.isalpha() for c in t) for t in free - ends)
    reply = _bans(tokenizer, '{"utterance": "Ha! Ha! You missed a coil. Ha', structured=True)
    assert {"!", ".", "?", '"', '"}'} <= reply and not reply & ends  # or the utterance's close
    assert _bans(tokenizer, "Ha! You missed a coil. Ha") == set()  # said once
    assert _bans(tokenizer, "Ha! Ha! Ha ha") == set()  # another sentence
    assert _bans(tokenizer, "Ha! Ha! Hal") == set()
    assert _bans(tokenizer, "Ha! Ha! Ha ha", limit=0) == set()
    assert "!" in _bans(tokenizer, "HA! ha... \u201cHa")  # any case or punctuation inside
    assert "!" in _bans(tokenizer, "Ha! Ha", limit=1)


def _guarded(tokenizer, pieces: list) -> tuple[list[str], str]:  # noqa: ANN001
    """Feed ``pieces`` (texts, or token ids) to the grammar and the guard one token at a time:
    the tokens the guard banned at their step, and the reply's utterance."""
    ids: list[int] = []
    for piece in [*pieces, end_of_turn_ids(tokenizer)[:1]]:
        ids += _ids(tokenizer, piece) if isinstance(piece, str) else piece
    guard = SentenceGuard(tokenizer, end_of_turn_ids(tokenizer)).reply(2, structured=True)
    grammar = RowGrammar(tokenizer, TURN_SCHEMA, len(tokenizer), 160)
    banned = []
    for k, token in enumerate(ids):
        assert bool(grammar.allowed(k, len(tokenizer))[token]), (k, tokenizer.decode([token]))
        grammar.consume(token)
        if token in guard.bans(ids[:k]):
            banned.append(tokenizer.decode([token]))
    return banned, validate_reply(tokenizer.decode(ids, skip_special_tokens=True), TURN_SCHEMA)["utterance"]


def _byte_tokens(tokenizer, text: str) -> list[int]:  # noqa: ANN001
    """``text`` as one-byte tokens (byte-level BPE's alphabet: GPT-2's bytes-to-unicode map)."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in table:
            table[b], extra = chr(256 + extra), extra + 1
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode()]


@pytest.mark.parametrize(
    ("third", "utterance"),
    [
        (["Halt\\nHalt\\nHalt"], "Halt\nHalt\nHalt"),  # an escaped line break ends a sentence
        (['Go now! Go \\"now\\"! Go now'], 'Go now! Go "now"! Go now'),  # a quote inside is plain
        (["Go now! Go {now}! Go now"], "Go now! Go {now}! Go now"),  # so is a brace
        ("ellipsis", "Ha\u2026 Ha\u2026 Ha"),  # "…" written as three byte tokens
    ],
)
def test_no_way_of_writing_a_third_copy_gets_through(tokenizer, third, utterance: str) -> None:  # noqa: ANN001
    if third == "ellipsis":
        dots = _byte_tokens(tokenizer, "\u2026")
        assert tokenizer.decode(dots) == "\u2026" and all("\ufffd" in tokenizer.decode([t]) for t in dots)
        third = ["Ha", dots, " Ha", dots, " Ha"]
    banned, said = _guarded(tokenizer, ['{"utterance": "', *third, '!"}'])
    assert said == utterance + "!" and repeats_sentence(said)  # the unguarded reply fails the check
    assert banned  # and the guard banned the token that made it so


def test_an_accent_that_completes_a_third_copy_is_banned() -> None:
    """wordfreq joins "Cafe" and a combining acute into "café": the token "\u0301!" ends one."""
    tokenizer = _bpe(ACCENTED)
    mark = _ids(tokenizer, "\u0301!")
    assert len(mark) == 1  # one token: the combining acute and the mark
    banned, said = _guarded(tokenizer, ['{"utterance": "', "Caf\u00e9! Caf\u00e9! Cafe", mark, '"}'])
    assert repeats_sentence(said) and banned == [tokenizer.decode(mark)]


# the second review (of af678d3): escapes, a lone backslash, U+FFFD, marks beside byte pieces


def test_an_escaped_unicode_line_break_cannot_end_a_third_copy(tokenizer) -> None:  # noqa: ANN001
    """The grammar allows \\u00XX escapes; "\\u000a" is a line break. At "\\u000" the guard bans
    nothing (any escape but "\\" is skipped), so "a" (or "A", "and", ...) ends "Ha" a third time."""
    banned, said = _guarded(tokenizer, ['{"utterance": "Ha! Ha! Ha\\u000a"}'])
    assert said == "Ha! Ha! Ha\n" and repeats_sentence(said)
    assert banned


def test_an_escaped_quote_after_a_lone_backslash_cannot_end_a_third_copy() -> None:
    """After a token ending in a backslash the guard bans only tokens starting with "n"; the
    token '".' (an escaped quote, then a mark) ends 'Go now"' = "go now" a third time."""
    tokenizer = _bpe(QUOTED + TEXTS)
    backslash, quote_dot = _one(tokenizer, "\\"), _one(tokenizer, '".')
    head = _ids(tokenizer, '{"utterance": "Go now! Go now! Go now')
    banned, said = _guarded(tokenizer, [head, [backslash, quote_dot], '"}'])
    assert said == 'Go now! Go now! Go now".' and repeats_sentence(said)
    assert banned


def test_a_literal_replacement_character_does_not_hide_the_third_copy(tokenizer) -> None:  # noqa: ANN001
    """U+FFFD is a valid character the grammar allows; the guard takes a reply ending in it for a
    character whose bytes are still arriving and checks only byte pieces, so "!" goes through."""
    banned, said = _guarded(tokenizer, ['{"utterance": "Ha! Ha! Ha\ufffd!"}'])
    assert said == "Ha! Ha! Ha\ufffd!" and repeats_sentence(said)
    assert banned


def test_a_token_holding_a_mark_then_the_start_of_a_character_is_banned() -> None:
    """'.\\xe2\\x80' decodes alone as ".\\ufffd": the guard's table skips every token holding a
    pending byte, so it never bans the "." that ends "Ha" a third time (then "\\x9d": '”')."""
    tokenizer = _bpe(MARK_THEN_LEAD)
    dot_lead = tokenizer.convert_tokens_to_ids(".\u00e2\u0122")  # ".", 0xe2, 0x80
    assert dot_lead is not None and tokenizer.decode([dot_lead]) == ".\ufffd"
    tail = tokenizer.convert_tokens_to_ids("\u013f")  # 0x9d
    banned, said = _guarded(tokenizer, ['{"utterance": "Ha! Ha! Ha', [dot_lead, tail], '"}'])
    assert said == "Ha! Ha! Ha.\u201d" and repeats_sentence(said)
    assert banned


def test_a_token_finishing_a_character_then_a_mark_is_banned() -> None:
    """'\\x9d.' finishes '”' and then ends the sentence 'Ha”' (= "ha") with ".": the guard checks
    only whether the finished character is itself a mark."""
    tokenizer = _bpe(TAIL_THEN_MARK)
    tail_dot = tokenizer.convert_tokens_to_ids("\u013f.")  # 0x9d, "."
    assert tail_dot is not None and tokenizer.decode([tail_dot]) == "\ufffd."
    lead = tokenizer.convert_tokens_to_ids(["\u00e2", "\u0122"])  # 0xe2, 0x80
    banned, said = _guarded(tokenizer, ['{"utterance": "Ha! Ha! Ha', lead, [tail_dot], '"}'])
    assert said == "Ha! Ha! Ha\u201d." and repeats_sentence(said)
    assert banned


# the third review (of 110a649): special tokens, byte fallback, spacing marks, prepends


def _stepped_bans(tokenizer, ids: list[int], structured: bool = False) -> set[int]:  # noqa: ANN001
    """The bans after ``ids``, asked at every step as a decoder asks them."""
    sentences = SentenceGuard(tokenizer, end_of_turn_ids(tokenizer)).reply(2, structured)
    for k in range(len(ids)):
        sentences.bans(ids[:k])
    return sentences.bans(ids)


def test_a_special_token_the_decode_skips_does_not_hide_a_third_copy(tokenizer) -> None:  # noqa: ANN001
    """An added token marked special but not in ``all_special_ids`` (SmolLM2 has 14: <repo_name>,
    <filename>, ...) is dropped by ``decode(skip_special_tokens=True)``; token_bytes reads its
    content, so "Ha<tool>" is not "Ha" to the guard and "!" ends a third "Ha"."""
    from tokenizers import AddedToken

    tokenizer = _bpe(TEXTS)  # its own copy: a token is added to it
    tokenizer.add_tokens([AddedToken("<tool>", special=True)])
    tool = tokenizer.convert_tokens_to_ids("<tool>")
    assert tool not in tokenizer.all_special_ids
    ids, bang = [*_ids(tokenizer, "Ha! Ha! Ha"), tool], _ids(tokenizer, "!")[0]
    said = tokenizer.decode([*ids, bang], skip_special_tokens=True)
    assert said == "Ha! Ha! Ha!" and repeats_sentence(said)
    assert bang in _stepped_bans(tokenizer, ids)


def test_a_character_written_in_byte_fallback_tokens_does_not_hide_a_third_copy() -> None:
    """A SentencePiece-style tokenizer (Gemma's: byte fallback, no ByteLevel decoder) writes a
    character it lacks as <0xNN> pieces; token_bytes takes each piece's text alone (U+FFFD), so
    the third "Ɐ" (an alphabetic letter) read as three U+FFFD is no sentence to the guard."""
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    letter = "\u2c6f"
    vocab = {"<pad>": 0, "<eos>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ["\u2581", "!", letter, "\u2581" + letter]:
        vocab[piece] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<pad>")
    bang = vocab["!"]
    ids = [vocab[letter], bang, vocab["\u2581" + letter], bang, vocab["\u2581"]]
    ids += [2 + b for b in letter.encode()]  # the third letter as its three bytes
    said = tokenizer.decode([*ids, bang], skip_special_tokens=True)
    assert said == f"{letter}! {letter}! {letter}!" and repeats_sentence(said)
    assert bang in _stepped_bans(tokenizer, ids)


def test_a_spacing_mark_that_composes_with_the_letter_before_it_cannot_end_a_third_copy() -> None:
    """wordfreq's NFC joins Tamil O and the AU length mark (U+0BD7, combining class 0) into the
    letter AU: the token "\u0bd7!" after "O" ends "AU" a third time. The fast path keys tokens by
    their letters and checks in context only those whose first character is combining (class > 0)."""
    tokenizer = _bpe(TAMIL + TEXTS)
    mark = _ids(tokenizer, "\u0bd7!")
    assert len(mark) == 1 and tokenizer.decode(mark) == "\u0bd7!"
    for structured, head in ((False, ""), (True, '{"utterance": "')):
        ids = _ids(tokenizer, head + "\u0b94! \u0b94! \u0b92")
        said = tokenizer.decode(ids + mark)[len(head) :]
        assert said == "\u0b94! \u0b94! " + AU + "!" and repeats_sentence(said)
        assert mark[0] in _stepped_bans(tokenizer, ids, structured), structured


def test_a_word_that_takes_in_the_space_after_it_is_read_whole_at_every_step(tokenizer) -> None:  # noqa: ANN001
    """A prepended letter (Malayalam dot reph, U+0D4E; also U+0600) takes the space after it into
    its grapheme and wordfreq's token: "\u0d4e  ha" is ("\u0d4e  ", "ha"). Asked at "\u0d4e ", the
    guard caches ("\u0d4e ",) before the space and never re-reads it, so at "\u0d4e  ha" it sees
    ("\u0d4e ", "ha") and lets "!" end a third copy; a guard asked only at the end bans it."""
    reph = "\u0d4e"
    ids = [*_ids(tokenizer, f"{reph}  ha! {reph}  ha! {reph}"), *_ids(tokenizer, " "), *_ids(tokenizer, " ")]
    ids += _ids(tokenizer, "ha")
    bang = _ids(tokenizer, "!")[0]
    said = tokenizer.decode([*ids, bang])
    assert said == f"{reph}  ha! {reph}  ha! {reph}  ha!" and repeats_sentence(said)
    assert bang in SentenceGuard(tokenizer, end_of_turn_ids(tokenizer)).reply(2, False).bans(ids)
    assert bang in _stepped_bans(tokenizer, ids)


def test_keys_and_other_fields_are_not_counted_with_the_utterance(tokenizer) -> None:  # noqa: ANN001
    assert "!" not in _bans(tokenizer, '{"utterance": "Utterance! Utterance', structured=True)
    assert '"' not in _bans(tokenizer, '{"utterance": "Calm. Calm.", "emotion": "calm', structured=True)
    assert '"' in _bans(
        tokenizer, '{"utterance": "Calm. Calm.", "emotion": "Calm! calm. calm', structured=True
    )


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
    sentences = guard.reply(2, structured=True) if guard else None
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


def test_a_third_copy_that_runs_on_without_white_space_is_still_banned(tokenizer) -> None:  # noqa: ANN001
    """Past 256 characters without white space only the run's end is re-read each step (the
    second review's 12,000-character run cost 22 ms a step); the bans stay those of a full read."""
    long = _bans(tokenizer, '{"utterance": "Ha! Ha! Ha' + "#" * 600, structured=True)
    assert {"!", '"'} <= long
    assert _bans(tokenizer, '{"utterance": "Ha! Ha! Hal' + "#" * 600, structured=True) == set()
