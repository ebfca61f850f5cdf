"""A turn-only knob (``registers.variety.<level>.turn_repetition_penalty``, issue 38) changes
no request the teacher is asked, so it must not rename the synthetic corpus: the synth
fingerprint (and through it every adapter's and every federation's) is the teacher's view of
the catalogue. It read ``dataclasses.asdict(catalogue)`` whole, so adding or tuning the turn
penalty moved the synthetic corpus to a new folder (``find_synth`` misses, the adapters retrain)
although every baseline knob and request key stayed the same."""

from __future__ import annotations

import dataclasses

from nimmer_train.synth.synthesize import synth_fingerprint
from nimmer_train.voice.registers import RegistersConfig
from nimmer_train.voice.sampling import baseline
from tests.helpers.compose import config


def _with_turn_penalty(catalogue: RegistersConfig, value: float | None) -> RegistersConfig:
    variety = {
        name: dataclasses.replace(level, turn_repetition_penalty=value)
        for name, level in catalogue.variety.items()
    }
    return RegistersConfig(catalogue.version, variety, catalogue.catalogue)


def test_the_turn_penalty_leaves_the_synth_fingerprint_as_the_teachers_knobs_do() -> None:
    cfg = config()
    shipped = cfg.registers  # very_low and low: turn_repetition_penalty 1.1
    teachers = _with_turn_penalty(shipped, None)  # what the teacher is asked with: unchanged
    tuned = _with_turn_penalty(shipped, 1.2)
    for name in shipped.names:  # the premise: the teacher's knobs (the replay keys) are the same
        assert baseline(shipped, name) == baseline(teachers, name) == baseline(tuned, name)

    def fp(catalogue: RegistersConfig) -> str:
        return synth_fingerprint(cfg.composition, catalogue, cfg.teacher, cfg.curation)

    assert fp(shipped) == fp(teachers) == fp(tuned)


def test_the_sentence_guard_leaves_the_synth_fingerprint_too() -> None:
    cfg = config()
    shipped = cfg.registers  # every level: max_sentence_repeats 2

    def guarded(limit: int) -> RegistersConfig:
        variety = {
            name: dataclasses.replace(level, max_sentence_repeats=limit)
            for name, level in shipped.variety.items()
        }
        return RegistersConfig(shipped.version, variety, shipped.catalogue)

    def fp(catalogue: RegistersConfig) -> str:
        return synth_fingerprint(cfg.composition, catalogue, cfg.teacher, cfg.curation)

    assert {level.max_sentence_repeats for level in shipped.variety.values()} == {2}
    assert fp(shipped) == fp(guarded(0)) == fp(guarded(5))
