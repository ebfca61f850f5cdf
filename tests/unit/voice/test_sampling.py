"""Per-turn sampling knobs: the design's scene table per register, moved by traits and affect,
capped in length and overridden by the director within the register's bounds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import baseline, bounds, shape_knobs

CATALOGUE = load_catalogue()


def test_knobs_follow_the_scene_table_traits_and_affect() -> None:
    for name in CATALOGUE.names:  # the register's own profile at neutral affect: the design's row
        table = baseline(CATALOGUE, name)
        turn = shape_knobs(CATALOGUE, name, CATALOGUE.get(name).traits).knobs
        level = CATALOGUE.variety[CATALOGUE.get(name).sampling.variety]
        assert turn == dataclasses.replace(  # the runtime's guards (n-gram, sentence), the turn penalty
            table, no_repeat_ngram_size=6, max_sentence_repeats=2, repetition_penalty=level.turn_penalty
        )
    assert (
        baseline(CATALOGUE, "drunk-scavenger").temperature,
        baseline(CATALOGUE, "caste-preacher").top_p,
    ) == (1.1, 0.6)
    calm = shape_knobs(CATALOGUE, "clasp-confession", None, arousal=0.1).knobs
    agitated = shape_knobs(CATALOGUE, "clasp-confession", None, arousal=0.9, valence=-0.8).knobs
    assert agitated.temperature > calm.temperature and agitated.top_p > calm.top_p
    assert agitated.repetition_penalty > calm.repetition_penalty
    restrained = dict(CATALOGUE.get("clasp-confession").traits, Sophrosyne=0.9)
    assert (
        shape_knobs(CATALOGUE, "clasp-confession", restrained).knobs.temperature
        < baseline(CATALOGUE, "clasp-confession").temperature
    )


def test_a_turn_starts_from_its_levels_turn_penalty_and_the_teacher_from_its_own() -> None:
    """The teacher's knobs (what the replay set is keyed on) keep the level's repetition penalty;
    an NPC turn of a very_low register starts above it (at 1.0 SmolLM2 looped "The cistern is
    full. The cistern is empty. ..."), and the director's bounds span both."""
    import pytest

    from nimmer_train.errors import ConfigError
    from nimmer_train.voice.registers import RegistersConfig

    level = CATALOGUE.variety["very_low"]
    assert baseline(CATALOGUE, "hivemind-broadcast").repetition_penalty == level.repetition_penalty == 1.0
    assert shape_knobs(CATALOGUE, "hivemind-broadcast").knobs.repetition_penalty == level.turn_penalty == 1.1
    assert bounds(CATALOGUE, "hivemind-broadcast")["repetition_penalty"] == (1.0, 1.1)  # the lever stays
    same = dataclasses.replace(level, turn_repetition_penalty=None)
    assert same.turn_penalty == same.repetition_penalty  # null: the teacher's
    bad = {**CATALOGUE.variety, "very_low": dataclasses.replace(level, turn_repetition_penalty=0.0)}
    with pytest.raises(ConfigError, match=r"registers\.variety\.very_low\.turn_repetition_penalty"):
        RegistersConfig(CATALOGUE.version, bad, CATALOGUE.catalogue)


def test_the_length_cap_and_the_directors_overrides_are_shaped_in_the_same_call() -> None:
    import pytest

    from nimmer_train.errors import NimmerError

    plain = shape_knobs(CATALOGUE, "caste-preacher", max_new_tokens=48)
    assert plain.director_overrides == {} and plain.knobs.max_new_tokens == 48
    low, high = bounds(CATALOGUE, "caste-preacher")["temperature"]
    directed = shape_knobs(CATALOGUE, "caste-preacher", director={"temperature": high, "top_k": 15})
    assert directed.knobs == dataclasses.replace(plain.knobs, temperature=high, top_k=15, max_new_tokens=160)
    assert directed.director_overrides == {
        "temperature": {"from": plain.knobs.temperature, "to": high},
        "top_k": {"from": plain.knobs.top_k, "to": 15},
    }
    with pytest.raises(NimmerError, match=r"outside register 'caste-preacher'.s bounds"):
        shape_knobs(CATALOGUE, "caste-preacher", director={"temperature": high + 0.1})
    with pytest.raises(NimmerError, match="not a sampling knob"):
        shape_knobs(CATALOGUE, "caste-preacher", director={"max_new_tokens": 10})
    assert low < plain.knobs.temperature < high


def test_sample_rows_draws_each_rows_distribution_and_never_a_masked_token() -> None:
    import torch

    from nimmer_train.voice.sampling import sample_rows

    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0, 1.0]])
    scores = probs.log()  # zero probability: -inf
    draws = 4000
    gens = [torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    counts = torch.zeros_like(probs)
    for _ in range(draws):
        for row, token in enumerate(sample_rows(scores, gens)):
            counts[row, token] += 1
    assert counts[probs == 0].sum() == 0  # never a masked token
    expected = probs[0, [1, 3, 4]] * draws
    chi2 = float(((counts[0, [1, 3, 4]] - expected) ** 2 / expected).sum())
    assert chi2 < 13.8  # 2 degrees of freedom, p = 0.001
    # a seeded row draws the same tokens alone as beside another row
    alone = [sample_rows(scores[:1], [torch.Generator().manual_seed(7)])[0] for _ in range(1)]
    paired = sample_rows(scores, [torch.Generator().manual_seed(7), torch.Generator().manual_seed(9)])
    assert alone[0] == paired[0]
    edge = sample_rows(torch.tensor([[0.0, float("-inf")]]), [torch.Generator().manual_seed(0)])
    assert edge == [0]


def test_the_ngram_guard_bans_what_hf_bans_on_the_reply_and_never_empties_a_row() -> None:
    """repeated_ngram_bans is HF's NoRepeatNGramLogitsProcessor over the reply's own tokens (the
    prompt never counts), and a ban that would leave a row nothing (a grammar allowing only the
    banned token) is not applied: the grammar wins, the row never dies."""
    import random

    import torch
    from transformers import NoRepeatNGramLogitsProcessor

    from nimmer_train.voice.sampling import SamplingKnobs, knob_processors, repeated_ngram_bans, warp_rows

    rng = random.Random(0)
    for _ in range(200):
        n, reply = rng.randint(1, 5), [rng.randint(0, 6) for _ in range(rng.randint(0, 30))]
        scores = torch.zeros(1, 8)
        hf = NoRepeatNGramLogitsProcessor(n)(torch.tensor([reply], dtype=torch.long), scores.clone())
        assert repeated_ngram_bans(reply, n) == set(torch.isinf(hf[0]).nonzero().flatten().tolist())
    # a prompt with the same 2-gram bans nothing; the reply's own does
    knobs = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, no_repeat_ngram_size=2)
    out = knob_processors(knobs, 3)(torch.tensor([[4, 5, 4, 7]]), torch.zeros(1, 8))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == []
    out = knob_processors(knobs, 1)(torch.tensor([[9, 4, 5, 4]]), torch.zeros(1, 10))
    assert torch.isinf(out[0]).nonzero().flatten().tolist() == [5]
    # "The gate is closed. The gate is" at n = 4: " closed" is banned; alone under a grammar, it stays
    loop = [11, 12, 13, 14, 15, 11, 12, 13]
    assert repeated_ngram_bans(loop, 4) == {14}
    only = torch.full((2, 20), float("-inf"))
    only[0, 14] = 0.0  # a grammar that allows " closed" only
    only[1, [14, 3]] = 0.0  # or " closed" and another token
    guarded = warp_rows(
        only, [knobs.__class__(1.0, 1.0, 0, 1.0, 0.0, no_repeat_ngram_size=4)] * 2, [loop, loop]
    )
    assert torch.isfinite(guarded[0]).nonzero().flatten().tolist() == [14]
    assert torch.isfinite(guarded[1]).nonzero().flatten().tolist() == [3]


def test_the_ngram_guard_is_checked_in_the_config_dropped_by_ring_c_and_safe_past_the_vocabulary(
    tmp_path: Path,
) -> None:
    """A guard nimmer serve would refuse (outside 0-64) fails the catalogue naming the key; a
    Ring C provider never gets it and the turn says so; a reply id past the scores bans nothing."""
    import pytest
    import torch
    import yaml

    from nimmer_train.config.providers import adapt
    from nimmer_train.errors import ConfigError
    from nimmer_train.voice.registers import CONF_DIR
    from nimmer_train.voice.sampling import SamplingKnobs, warp_rows

    raw = yaml.safe_load((CONF_DIR / "v1.yaml").read_text())
    raw["variety"]["low"]["no_repeat_ngram_size"] = -1
    (tmp_path / "v1.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match=r"registers\.variety\.low\.no_repeat_ngram_size.*\[0, 64\]"):
        load_catalogue(path=tmp_path / "v1.yaml")
    guarded = shape_knobs(CATALOGUE, "drunk-scavenger").knobs
    for provider in ("anthropic", "together"):
        assert "no_repeat_ngram_size_unsupported_dropped" in adapt(guarded, provider)[1]
    assert (
        "no_repeat_ngram_size_unsupported_dropped"
        not in adapt(baseline(CATALOGUE, "drunk-scavenger"), "together")[1]
    )
    knobs = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, no_repeat_ngram_size=2)
    out = warp_rows(torch.zeros(1, 10), [knobs], [[12, 12]])  # 12 is past a 10-token vocabulary
    assert torch.isfinite(out).all()
