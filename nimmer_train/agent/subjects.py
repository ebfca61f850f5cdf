"""Whose fact a remembered line states, and whether that is whom a question asks about.

A sentence model scores the topic, not the person: all-MiniLM-L6-v2 puts "Where do I live?" as
near to "My friend Vera lives in Ghent" as to the player's own "We settled into our new flat in
Turin". A companion's memory holds the player's facts among the same facts said of other people
(a friend's move, a colleague's new job, a neighbour's allergy), so search asks whose fact a
player's line states and lets a line about someone else lose places for a question about the
player (search.py ``SearchWeights.other``). Rules, for English and the player's lines only:

- a line is the player's own when it has a first-person subject (I, we, their contractions):
  "My friend and I went sailing" is the player's;
- else it is about a relation when it says one of the player's ("my friend", "our new
  neighbour", "my colleague's sister"), about the listener when it says "you", about a named
  person when it opens with a capitalised word that is no common opener and not shaped like a
  verb or an adverb ("Greta just started a new job"; "Moved to Turin last week" is not a name);
- else it says no one: "First week at the library went well" is left alone.

A question asks about the player when it has a first-person word (I, me, my, we, us, our) and
names no relation; about a relation when it says "my sister"; else about no one in particular,
and then nothing changes (questions that name a person in the third person, as a public
long-conversation benchmark asks them, are ranked as before). A line about a named person never
counts against a relation question: "Tomas moved to Oslo" may be the second hop of "where does
my best friend live?".

What this cannot see: a line about the player that has no first-person subject and opens with a
word the rules read as a name, and irony or reported speech ("Greta says I should move"). Such a
line loses places for a question about the player; it is not removed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nimmer_train.voice.prompt_dsl import PLAYER

_RELATION_WORDS = """friend friends colleague colleagues coworker coworkers neighbour neighbor neighbours
    neighbors sister sisters brother brothers mother mum mom father dad parents wife husband
    partner son sons daughter daughters kids children child boss manager cousin cousins aunt uncle
    niece nephew grandmother grandfather grandma grandpa gran granny grandparents boyfriend
    girlfriend fiance fiancee roommate flatmate housemate classmate teammate teacher coach doctor
    landlord landlady mentor"""
_OPENER_WORDS = """a an the this that these those it its there here what when where why how who whom whose
    which do does did is are was were am be been have has had can could would should will shall
    may might must my our your his her their he she they him them me us i we you yes no not oh ah
    well so and but or if because since after before once then still anyway sorry please thanks
    thank hey hi hello maybe perhaps just also even only really honestly actually finally today
    yesterday tomorrow tonight now first last next every some any all both each most many much
    monday tuesday wednesday thursday friday saturday sunday january february march april june
    july august september october november december by at in on of for from with about to as
    guess anyway lately recently"""
RELATIONS = frozenset(_RELATION_WORDS.split())
OPENERS = frozenset(_OPENER_WORDS.split())
_FIRST_PERSON_SUBJECT = re.compile(r"\b(?:I|I'm|I've|I'd|I'll|we|we're|we've|we'd|we'll)\b", re.I)
_FIRST_PERSON = re.compile(r"\b(?:I|me|my|mine|myself|we|us|our|ours)\b", re.I)
_RELATION = re.compile(rf"\b(?:my|our)\s+(?:[a-z]+\s+)?({'|'.join(sorted(RELATIONS))})\b", re.I)
_LISTENER = re.compile(r"\b(?:you|you're|you've|your|yours)\b", re.I)
_OPENING = re.compile(r"\s*([A-Z][a-z]+)\b")


@dataclass(frozen=True)
class Subject:
    """Whom a line or a question is about: ``self`` (the player), ``relation`` (``who`` is the
    relation word), ``listener`` or ``named`` (``who`` is the name)."""

    kind: str
    who: str = ""


PLAYER_SELF = Subject("self")


def asked_about(question: str) -> Subject | None:
    """Whom ``question`` asks about: the player, one of the player's relations, or None."""
    relation = _RELATION.search(question)
    if relation:
        return Subject("relation", _singular(relation.group(1)))
    return PLAYER_SELF if _FIRST_PERSON.search(question) else None


def said_about(line: str) -> Subject | None:
    """Whose fact the player's ``line`` states (see the module docstring), or None."""
    if _FIRST_PERSON_SUBJECT.search(line.replace("\u2019", "'")):
        return PLAYER_SELF
    relation = _RELATION.search(line)
    if relation:
        return Subject("relation", _singular(relation.group(1)))
    if _LISTENER.search(line):
        return Subject("listener")
    opening = _OPENING.match(line)
    if opening and _is_name(opening.group(1)):
        return Subject("named", opening.group(1))
    return None


def about_another(asked: Subject | None, said: Subject | None) -> bool:
    """Whether a line about ``said`` states someone else's fact for a question about ``asked``."""
    if asked is None or said is None or said == PLAYER_SELF:
        return False
    if asked == PLAYER_SELF:
        return True
    return said.kind == "listener" or (said.kind == "relation" and said.who != asked.who)


def player_said(text: str) -> str:
    """The player's lines of a transcript crystal's text ("player: ..." lines, continued ones
    too), joined; empty for any other crystal."""
    lines = (line.split(": ", 1) for line in text.split("\n"))
    return " ".join(
        said for label, *rest in lines for said in rest if label in (PLAYER, f"{PLAYER} (continued)")
    )


def _is_name(word: str) -> bool:
    lower = word.lower()
    return lower not in OPENERS and not lower.endswith(("ed", "ing", "ly")) and len(word) > 1


def _singular(word: str) -> str:
    word = word.lower()
    return {"children": "child", "kids": "kid", "parents": "parent"}.get(word, word.removesuffix("s"))
