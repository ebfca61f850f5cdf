"""Per-turn sampling knobs: the design's scene table per register, moved by traits and affect."""

from __future__ import annotations

from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import baseline, for_turn

CATALOGUE = load_catalogue()


def test_knobs_follow_the_scene_table_traits_and_affect() -> None:
    for name in CATALOGUE.names:  # the register's own profile at neutral affect: the design's row
        table = baseline(CATALOGUE, name)
        assert for_turn(CATALOGUE, name, CATALOGUE.get(name).traits) == table
    assert (
        baseline(CATALOGUE, "drunk-scavenger").temperature,
        baseline(CATALOGUE, "caste-preacher").top_p,
    ) == (1.1, 0.6)
    calm = for_turn(CATALOGUE, "clasp-confession", None, arousal=0.1)
    agitated = for_turn(CATALOGUE, "clasp-confession", None, arousal=0.9, valence=-0.8)
    assert agitated.temperature > calm.temperature and agitated.top_p > calm.top_p
    assert agitated.repetition_penalty > calm.repetition_penalty
    restrained = dict(CATALOGUE.get("clasp-confession").traits, Sophrosyne=0.9)
    assert (
        for_turn(CATALOGUE, "clasp-confession", restrained).temperature
        < baseline(CATALOGUE, "clasp-confession").temperature
    )


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
