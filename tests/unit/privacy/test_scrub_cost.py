"""The contact-detail scrub costs what prose costs, whatever the text: the intake runs it on
every upload it is sent, so a text built to make the patterns backtrack ("a." repeated, the
review's payload, made the old URL pattern retry up to 127 labels at every label start) must not
buy more CPU than prose of the same length. Measured side by side as a ratio (CPU time, best of
three), never as an absolute time. The redactions themselves stay what they were."""

from __future__ import annotations

import time

import pytest

from nimmer_train.privacy.anonymize import scrub

SIZE = 100_000  # characters: about the intake's cap on one upload
PROSE = "The ferryman counted the lanterns twice and sang to the hive before dawn. "
ADVERSARIAL = {
    "dotted labels": "a.",
    "hyphenated labels": "a-.",
    "digit labels": "1.",
    "hyphen groups": "1-",
    "local parts": "a.a@",
    "glued emails": "a@b.io+",
    "hyphen words": "a-",
    "dotted runs with paths": "a.b/",  # a run that is no domain must not take the rest as its path
}


def _cost(text: str) -> float:
    """The best of three CPU times of scrubbing ``text``."""
    best = float("inf")
    for _ in range(3):
        start = time.process_time()
        scrub(text, "player-1", "Ilse Varga")
        best = min(best, time.process_time() - start)
    return best


def _sized(unit: str) -> str:
    return (unit * (SIZE // len(unit) + 1))[:SIZE]


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_scrubbing_a_text_built_to_backtrack_costs_about_what_prose_costs(name: str) -> None:
    prose, attack = _cost(_sized(PROSE)), _cost(_sized(ADVERSARIAL[name]))
    assert attack < 5 * prose, f"{name}: {attack:.3f} s of CPU against {prose:.3f} s for prose"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # leftmost first, as the old patterns: a domain ends at its last top-level label
        ("foo.com.evil and foo.com-x", "[url].evil and [url]-x"),
        ("see foo.www.bar:x now", "see foo.[url] now"),  # a www. inside a run that is no domain
        ("see.http://x.com", "see.[url]"),
        ("example.com/path?q=1 and -mail.de.", "[url] and -[url]."),
        ("www.a.b x.example.co.uk/a", "[url] [url]"),
        ("1.2.3.4 is not a site, v1.2 neither", "[ip] is not a site, v1.2 neither"),
        ("u@h.io+v@w.io", "[email][email]"),
        ("a@b.c@d.e", "[email]@d.e"),
        ("x @a.b@c.d", "x @[email]"),
        ("u@h.io+" + "v" * 70 + "@w.io", "[email]+vvvvvv[email]"),  # glued: its last 64 characters
    ],
)
def test_the_linear_scan_redacts_what_the_backtracking_patterns_did(text: str, expected: str) -> None:
    assert scrub(text, "player-1", "Ilse Varga") == expected
