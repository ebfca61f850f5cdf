"""The voice report's intervals resample scenes (issue 38, the evaluation review's point (b)): a
cluster bootstrap over the scenes the turns were spoken in, checked here against the exact
bootstrap distribution enumerated by hand on a small made-up set; more turns of the same scenes
do not narrow it; under MIN_SCENES scenes the report gives none and says why."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from math import factorial

import numpy as np
import pytest

from nimmer_train.voice.quality import (
    MIN_SCENES,
    GeneratedTurn,
    SeedLine,
    distinct_n,
    fit_classifier,
    score,
    words,
)

CLASSIFIER = fit_classifier(
    [SeedLine("a", "s1", "Heh, mate, pfah, rotgut!"), SeedLine("b", "s1", "Directive: comply. Logged.")] * 3
)
# five scenes, register "a": valid and invalid replies, some bigrams shared across scenes
SCENES = {
    "s1": ["the gate is shut tonight", "the gate is shut"],
    "s2": ["bring the lamp here", None],
    "s3": [None, None, "wardens walk at dusk"],
    "s4": ["the gate is open", "no bread tonight", "the lamp is out"],
    "s5": ["hush now child"],
}


def _turns(scenes: dict[str, list[str | None]], register: str = "a") -> list[GeneratedTurn]:
    return [
        GeneratedTurn(register, None if u is None else json.dumps({"utterance": u}), scene=scene)
        for scene, utterances in scenes.items()
        for u in utterances
    ]


def _exact(per_scene: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Every resample of the scenes (a multiset of S draws) with its multinomial probability, and
    the ratio sum(num) / sum(den) it gives: the bootstrap distribution, enumerated."""
    s = len(per_scene)
    out = []
    for draw in itertools.combinations_with_replacement(range(s), s):
        counts = Counter(draw)
        prob = factorial(s) / np.prod([factorial(c) for c in counts.values()]) / s**s
        num = sum(c * per_scene[i][0] for i, c in counts.items())
        den = sum(c * per_scene[i][1] for i, c in counts.items())
        if den > 0:
            out.append((num / den, prob))
    return out


def _quantile(dist: list[tuple[float, float]], q: float) -> float:
    """The inverted-CDF quantile of a discrete distribution (renormalised over its support)."""
    total, acc = sum(p for _, p in dist), 0.0
    for value, p in sorted(dist):
        acc += p / total
        if acc >= q - 1e-12:
            return value
    return max(v for v, _ in dist)


def _check(interval: list[float], dist: list[tuple[float, float]]) -> None:
    low, high = interval
    assert _quantile(dist, 0.015) - 1e-4 <= low <= _quantile(dist, 0.035) + 1e-4, (low, dist)
    assert _quantile(dist, 0.965) - 1e-4 <= high <= _quantile(dist, 0.985) + 1e-4, (high, dist)


def test_the_intervals_are_the_scene_bootstrap_enumerated_by_hand() -> None:
    report = score(_turns(SCENES), CLASSIFIER, "v1", {"seed": 0}, draws=40_000)
    row = report.registers[0]
    assert report.interval_scenes == sorted(SCENES) and report.bootstrap == 40_000
    # schema-valid: per scene (valid replies, turns)
    schema = [(sum(u is not None for u in us), len(us)) for us in SCENES.values()]
    _check(row.intervals["schema_valid"], _exact(schema))
    # distinct-2, recomputed another way: each bigram occurrence weighs 1 / its count over the
    # register, so per scene (sum of weights, bigrams) and the whole sample's ratio is distinct-2
    grams = {
        scene: [g for u in us if u for ws in [words(u)] for g in zip(ws, ws[1:], strict=False)]
        for scene, us in SCENES.items()
    }
    counts = Counter(g for gs in grams.values() for g in gs)
    distinct = [(sum(1 / counts[g] for g in gs), len(gs)) for gs in grams.values()]
    texts = [u for us in SCENES.values() for u in us if u]
    assert abs(sum(n for n, _ in distinct) / sum(d for _, d in distinct) - distinct_n(texts)) < 1e-12
    assert row.distinct_2 == distinct_n(texts)
    _check(row.intervals["distinct_2"], _exact(distinct))
    # the figure lies inside its interval; the overall row of one register is that register's
    for name in ("schema_valid", "english_rate", "distinct_2"):
        low, high = row.intervals[name]
        assert low <= getattr(row, name) <= high
        assert report.overall.intervals[name] == row.intervals[name]


def test_more_turns_of_the_same_scenes_do_not_narrow_the_interval() -> None:
    """Ten copies of every turn, same scenes: the same interval (a bootstrap over turns would
    narrow it about three times); the same turns spread over twice the scenes narrow it."""
    once = score(_turns(SCENES), CLASSIFIER, "v1", {"seed": 0}).registers[0].intervals["schema_valid"]
    tenfold = {scene: us * 10 for scene, us in SCENES.items()}
    again = score(_turns(tenfold), CLASSIFIER, "v1", {"seed": 0}).registers[0].intervals["schema_valid"]
    assert again == once
    spread = {f"{scene}-{k}": us for scene, us in tenfold.items() for k in range(10)}
    wide, narrow = (
        once[1] - once[0],
        (lambda i: i[1] - i[0])(
            score(_turns(spread), CLASSIFIER, "v1", {"seed": 0}).registers[0].intervals["schema_valid"]
        ),
    )
    assert narrow < wide / 2


def test_registers_are_resampled_together_and_the_overall_is_their_mean() -> None:
    turns = _turns(SCENES, "a") + _turns({s: ["Directive: comply now. Logged."] for s in SCENES}, "b")
    report = score(turns, CLASSIFIER, "v1", {"seed": 0})
    rows = {r.register: r for r in report.registers}
    assert rows["b"].intervals["schema_valid"] == [1.0, 1.0]  # every b reply is valid in every scene
    low, high = report.overall.intervals["schema_valid"]
    a_low, a_high = rows["a"].intervals["schema_valid"]
    # the mean of a and a constant 1 (intervals are rounded to 4 places)
    assert (low, high) == pytest.approx(((a_low + 1) / 2, (a_high + 1) / 2), abs=1e-4)
    metrics = report.metrics()
    assert metrics["voice.v1.a.schema_valid_low"] == a_low and metrics["voice.v1.scenes"] == 5.0


def test_too_few_scenes_give_no_interval_and_the_report_says_so() -> None:
    two = {scene: SCENES[scene] for scene in ("s1", "s4")}
    report = score(_turns(two), CLASSIFIER, "v1", {"seed": 0})
    assert MIN_SCENES > 2 and report.bootstrap == 0 and report.registers[0].intervals == {}
    text = "\n".join(report.lines())
    assert "no interval: the turns span 2 scene(s), fewer than the 5 a scene bootstrap needs" in text
    report = score(_turns(SCENES), CLASSIFIER, "v1", {"seed": 0})
    assert "cluster bootstrap over the 5 scenes (s1, s2, s3, s4, s5; 2000 resamples" in "\n".join(
        report.lines()
    )
