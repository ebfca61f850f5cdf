"""Whose fact a remembered line states, and whether that is whom a question asks about.

A sentence model scores the topic, not the person: all-MiniLM-L6-v2 puts "Where do I live?" as
near to "My friend Vera lives in Ghent" as to the player's own "We settled into our new flat in
Turin". A companion's memory holds the player's facts among the same facts said of the player's
people (a friend's move, a colleague's sister, a neighbour's allergy), so search asks whose fact
a player's line states, and a line about the player's relations loses places for a question about
the player or about another relation (search.py ``SearchWeights.other``).

The rule, for English and every line of the player's message: a line is about the player's
relations when the player appears in it only as the owner of a named relation that opens a
clause ("My friend Vera lives in Ghent", "by the way, our neighbour Karl is allergic to cats";
mum, mom and mother are one relation, hubby is husband); it is the player's own when the player
appears in it any other way ("my wife and I moved", "my boss promoted me", "love falafel, my
favourite dish", "went hiking with my brother"); and a line where the player does not appear is
left alone ("Greta just started a new job", "do you think it will rain?", "got a job as a
nurse"). A first version also guessed names (a capitalised opener) and read "you" as the
listener's fact; an adversarial review showed both demoting the player's own "Yeah, settled into
our new flat", "Got a job as a nurse" and "moved to Turin, you should visit!" (docs/memory.md).

A question asks about a relation when it says one ("my sister's name"), else about the player
when it has a first-person word (I, me, my, we, us, our; the acronym "US" is not one), else about
no one in particular, and then nothing changes: a question that names a person in the third
person, as a public long-conversation benchmark asks them, is ranked as before.

A message is someone else's only when every sentence of it is ("My sister Ana is visiting. Oh and
got the job!" keeps the player's news). A relation is answered by its members and other names: a
question about "my parents" by "my mum Ana", about "my family" by "my brother Marc", about "my
boss" by "my manager Karl" (a third review).

What this cannot see: a fact about the player told by a named relation ("My boss Karl signed off
on the promotion", "my wife Lea is pregnant": out of the top 10 for the question about the player
in the third review's cases), a relation the table lacks, and irony. Such a line ranks below the
others for a question about the player; it is not removed. Only exchange crystals are read (a note
or a file that quotes "player: ..." is left alone).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nimmer_train.memory.entries import EXCHANGE_SPEAKER

USER_ROLES = ("user", "player")  # the player's words: an MCP client's "user", a turn's "player"
PLAYER_SPEAKERS = (*USER_ROLES, EXCHANGE_SPEAKER)  # the crystals whose player's lines are read

# a relation word -> the one word it is counted as ("mum", "mom" and "mother" are one relation)
_RELATION_WORDS = """friend friends:friend bestie:friend bff:friend mate:friend colleague
    colleagues:colleague coworker:colleague coworkers:colleague neighbour neighbor:neighbour
    neighbours:neighbour neighbors:neighbour sister sisters:sister sis:sister brother
    brothers:brother bro:brother sibling siblings:sibling mother mum:mother mom:mother
    father dad:father parents:parent folks:parent wife missus:wife wifey:wife husband
    hubby:husband partner son sons:son daughter daughters:daughter kids:child children:child
    child kid:child boss manager:boss cousin cousins:cousin aunt uncle niece nephew grandmother
    grandma:grandmother gran:grandmother granny:grandmother nan:grandmother nana:grandmother
    grandfather grandpa:grandfather grandparents:grandparent boyfriend bf:boyfriend girlfriend
    gf:girlfriend fiance fiancee ex roommate:flatmate flatmate housemate:flatmate classmate
    teammate landlord landlady mentor family relatives:family relative:family"""
RELATIONS = {
    word: (one or word) for word, _, one in (item.partition(":") for item in _RELATION_WORDS.split())
}
_KIN = "mother father sister brother son daughter wife husband partner grandmother grandfather"
# a relation that names others too: a question about "my parents" is answered by "my mum Ana ..."
UMBRELLAS = {
    "parent": {"mother", "father"},
    "sibling": {"sister", "brother"},
    "child": {"son", "daughter"},
    "grandparent": {"grandmother", "grandfather"},
    "partner": {"wife", "husband", "boyfriend", "girlfriend", "fiance", "fiancee"},
    "family": {*_KIN.split(), "parent", "sibling", "child", "grandparent", "cousin", "aunt", "uncle"},
}
FIRST_PERSON = frozenset(["i", "me", "my", "mine", "myself", "we", "us", "our", "ours"])
# words, and the marks that end a clause: "I'm" -> "i", "m"; "mum's" -> "mum", "s"
_TOKEN = re.compile(r"[A-Za-z]+|[.!?;,:\n]")
_ACRONYM_US = re.compile(r"\bUS\b")  # the country, not "us"
_SENTENCE = re.compile(r"(?<=[.!?])\s+|\n")
# a line is read up to here: a 4,000-character message read whole cost a search about 10 ms (40
# candidates at 0.25 ms), and whose fact a message states shows in its first sentences
READ_CHARS = 600


@dataclass(frozen=True)
class Subject:
    """Whom a line or a question is about: ``self`` (the player) or ``relation`` (``who``: the
    relations named, one word for each relation's synonyms)."""

    kind: str
    who: frozenset[str] = frozenset()


PLAYER_SELF = Subject("self")


def asked_about(question: str) -> Subject | None:
    """Whom ``question`` asks about: the player, the player's relations, or None."""
    relations, player = _read(question)
    if relations:
        return Subject("relation", relations)
    return PLAYER_SELF if player else None


def said_about(line: str) -> Subject | None:
    """Whose fact the player's ``line`` states: the player's when the player appears in it other
    than as the owner of a named relation, the relations' when every sentence (or line) names one
    and the player appears only so, else None."""
    relations: set[str] = set()
    for sentence in _SENTENCE.split(line[:READ_CHARS]):
        if not sentence.strip():
            continue
        named, player = _read(sentence)
        if player:
            return PLAYER_SELF
        if not named:  # a sentence about no relation: the message is not only theirs
            return None
        relations |= named
    return Subject("relation", frozenset(relations)) if relations else None


def about_another(asked: Subject | None, said: Subject | None) -> bool:
    """Whether a line about ``said`` states someone else's fact for a question about ``asked``."""
    if asked is None or said is None or said == PLAYER_SELF:
        return False
    return asked == PLAYER_SELF or not _with_members(asked.who) & _with_members(said.who)


def _with_members(relations: frozenset[str]) -> set[str]:
    return set(relations).union(*(UMBRELLAS.get(r, ()) for r in relations))


def player_said(text: str) -> str:
    """The player's lines of a transcript crystal's text, one a line: "player: ..." (or "user:
    ...") lines, continued ones, and the unlabelled lines of a message of several lines that
    follow them; empty for any other crystal."""
    said, mine = [], False
    for line in text.split("\n"):
        label, colon, rest = line.partition(": ")
        speaker = label.removesuffix(" (continued)")
        if colon and (speaker in USER_ROLES or speaker.startswith("npc:") or speaker == "assistant"):
            mine = speaker in USER_ROLES
            line = rest
        if mine:
            said.append(line)
    return "\n".join(said)


def _read(text: str) -> tuple[frozenset[str], bool]:
    """The relations ``text`` names as the player's ("my [best] friend"), and whether the player
    appears in it other than as the owner of a named relation that opens a clause: "My brother
    Marc moved to Oslo" is Marc's fact. Reviews found the player's own facts demoted when any
    relation counted: "went hiking with my brother" (not opening a clause), "my boss confirmed the
    promotion", "our landlord put the rent up" (no name: the relation tells the player's news).
    One pass over the words (a regex per relation phrase took 0.6 ms on a 4,000-character crystal,
    and a search reads 40 of them)."""
    tokens = _TOKEN.findall(_ACRONYM_US.sub(" ", text))
    words = [token.lower() for token in tokens]
    relations, owners = set(), set()
    for n, word in enumerate(words):
        if word not in ("my", "our"):
            continue
        at = next((k for k in (n + 1, n + 2) if k < len(words) and words[k] in RELATIONS), None)
        if at is None:
            continue
        relations.add(RELATIONS[words[at]])
        opens = n == 0 or not words[n - 1].isalpha()  # its clause's subject
        named = at + 1 < len(tokens) and tokens[at + 1][:1].isupper() and tokens[at + 1] != "I"
        if opens and named:
            owners.add(n)
    player = any(word in FIRST_PERSON and n not in owners for n, word in enumerate(words))
    return frozenset(relations), player
