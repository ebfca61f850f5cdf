"""No reply may say one sentence more than twice (issue 38): the check, its count in the report
and its place in the bar."""

from __future__ import annotations

import json

from nimmer_train.artifacts import REPO_ROOT
from nimmer_train.voice.quality import GeneratedTurn, bar_checks, repeats_sentence, score, seed_lines
from tests.unit.voice.test_scene_intervals import CLASSIFIER


def test_a_sentence_said_three_times_is_a_repeat_twice_is_not() -> None:
    assert repeats_sentence("Halt. Halt. Halt.")
    assert repeats_sentence("The patrol passes! the patrol passes... The PATROL, passes? Hide.")
    assert repeats_sentence("Comply\nComply\nComply")  # a line break ends a sentence too
    assert not repeats_sentence("Halt. Halt. Who goes there?")
    assert not repeats_sentence("I are not be not be not be not. The patrol passes.")  # one sentence
    assert not repeats_sentence("") and not repeats_sentence("...")
    # the hand-written seed set never does it
    assert not any(
        repeats_sentence(x.utterance) for x in seed_lines(REPO_ROOT / "data/seed/teacher_replay_v1.jsonl")
    )


def test_the_report_counts_repeating_replies_and_the_bar_fails_on_one() -> None:
    def turn(register: str, utterance: str) -> GeneratedTurn:
        return GeneratedTurn(register, json.dumps({"utterance": utterance}), scene="s1")

    turns = [turn("a", "Heh, mate. Heh, mate. Heh, mate. Rotgut!"), turn("a", "Heh, mate, pfah, rotgut!")]
    turns += [turn("b", "Directive: comply. Logged. Comply. Logged. Comply. Logged.")]
    report = score(turns, CLASSIFIER, "v1")
    rows = {r.register: r for r in report.registers}
    assert (rows["a"].repeats, rows["b"].repeats, report.overall.repeats) == (1, 1, 2)
    check = bar_checks(report.summary())[-1]
    assert check["goal"] == "replies repeating a sentence more than 2 times" and not check["passed"]
    assert "[FAIL] replies repeating a sentence more than 2 times: 2 (goal = 0)" in "\n".join(report.lines())
    assert report.metrics()["voice.v1.all.repeats"] == 2.0
    clean = score(turns[1:2], CLASSIFIER, "v1")
    assert bar_checks(clean.summary())[-1]["passed"]
