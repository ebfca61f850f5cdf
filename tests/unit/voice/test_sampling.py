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
