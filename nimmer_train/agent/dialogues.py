"""Seeded long multi-session dialogues with labelled evidence, for measuring recall on long
conversations (benchmarks/bench_conversation_memory.py and its test).

A conversation is ``sessions`` sessions of ``per_session`` exchanges (the player's line and the
NPC's reply), sessions 1 to 10 days apart, each with a date. Planted among small talk and
distractors (the same attributes said of other people: a colleague's sister, a friend's move):

- single-hop: a fact said once ("my sister is called Greta"), asked directly or paraphrased;
- multi-hop: two facts in different sessions that answer only together ("my best friend is
  Tomas" ... "Tomas moved to Oslo": "where does my best friend live now?");
- temporal: an event said "today" in a dated session, asked "when did I ...?" or "what did I do
  on 14 March?" (the answer is in the session's date, not in the words);
- updated fact: a fact that a later session changes; the latest statement is the evidence;
- open-domain: a question whose answer is inferred from a fact that shares no word with it
  ("would a clay workshop voucher please me?" from "I love pottery").

Every question carries its evidence turn ids ("D<session>:<turn>", LoCoMo's form) and the
sessions they are in. Nothing here reads a model or the network.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

DAY = 86400.0
START = 1_800_000_000.0  # 2027-01-15 UTC
CATEGORIES = ("single_hop", "multi_hop", "temporal", "updated_fact", "open_domain")
NAMES = (
    "Ilse",
    "Greta",
    "Tomas",
    "Jorunn",
    "Mara",
    "Pavel",
    "Ines",
    "Oskar",
    "Lena",
    "Birk",
    "Selma",
    "Anton",
    "Ruth",
    "Emil",
    "Vera",
    "Karl",
    "Nora",
    "Aksel",
)
CITIES = (
    "Hamburg",
    "Lisbon",
    "Munich",
    "Oslo",
    "Porto",
    "Vienna",
    "Ghent",
    "Krakow",
    "Turin",
    "Bergen",
    "Riga",
    "Lyon",
)
JOBS = ("nurse", "carpenter", "teacher", "baker", "electrician", "librarian", "pharmacist", "translator")
PLACES = ("city hospital", "harbour office", "public library", "train depot", "river school", "old mill")
MONTHS = ("March", "May", "July", "September", "November")
COLOURS = ("red", "blue", "green", "yellow", "grey", "white")
PETS = (("dog", "Biscuit"), ("cat", "Pepper"), ("parrot", "Kiwi"), ("rabbit", "Clover"), ("dog", "Rusty"))
FOODS = ("mushroom risotto", "lentil soup", "grilled sardines", "dumplings", "pumpkin pie", "falafel")
HOBBIES = {  # hobby -> an open-domain question it answers without sharing a word
    "pottery": "Would a voucher for a clay workshop make a good present for me?",
    "sailing": "Should you invite me for a weekend out on the sea on a boat?",
    "chess": "Would I enjoy a board-game tournament with strategy puzzles?",
    "birdwatching": "Would binoculars and a field guide to wildlife be a welcome gift for me?",
    "climbing": "Would I like a day at an indoor wall with ropes and a harness?",
    "woodcarving": "Would a set of sharp knives for shaping timber please me?",
}
ALLERGIES = {  # allergy -> open-domain question
    "shellfish": "Can I safely order the shrimp and lobster platter at dinner?",
    "peanuts": "Is a satay sauce made from groundnuts a safe choice for me?",
    "cats": "Would staying overnight with a family who keep three kittens be a problem for me?",
}
EVENTS = (  # (said "today", "when" question, the activity asked on a date)
    ("I ran my first half marathon today, my legs are jelly.", "When did I run my first half marathon?"),
    ("Today I finally passed my driving test!", "When did I pass my driving test?"),
    ("We planted an apple tree in the garden today.", "When did we plant the apple tree?"),
    ("I gave a talk at the town hall today, so nervous.", "When did I give my talk at the town hall?"),
    ("Today I sold my old piano to a neighbour.", "When did I sell my old piano?"),
    ("I baked bread for the first time today.", "When did I first bake bread?"),
)
FILLER = (
    "The weather has been {adj} all week.",
    "I watched a documentary about {topic} yesterday.",
    "My friend {name} lives in {city} and works as a {job}.",
    "Have you heard the news about {topic}?",
    "{name} told me she is thinking about getting a {pet}.",
    "I had {food} for lunch, it was fine.",
    "Traffic in {city} was terrible this morning.",
    "{name} wants to take up {hobby} next year.",
    "I'm a bit tired today, long day.",
    "Do you think it will rain on the weekend?",
    "My friend {name} moved from {city} to {city2} in the spring.",
    "{name} had her bike painted {colour}, it looks great.",
    "{name} just started a new job at the {place}.",
    "My colleague {name} has a sister called {name2}.",
    "My neighbour {name} is allergic to {allergy}, poor thing.",
    "{name} ran a marathon last year and never stops talking about it.",
)
TOPICS = ("volcanoes", "the election", "deep sea fish", "old castles", "electric cars", "bees")
ADJECTIVES = ("grey", "sunny", "windy", "cold", "strange")
REPLIES = (
    "That's interesting, tell me more.",
    "I see. How do you feel about that?",
    "Thanks for sharing that with me.",
    "Oh, I didn't know that.",
    "Noted! Anything else on your mind?",
    "Ha, that sounds like you.",
)


@dataclass(frozen=True)
class Question:
    text: str
    category: str
    evidence: tuple[str, ...]  # turn ids that answer it (all of them, for multi-hop)
    sessions: tuple[int, ...]  # the sessions of the evidence
    superseded: tuple[str, ...] = ()  # updated facts: the older, now wrong, statement


@dataclass
class Dialogue:
    exchanges: list[tuple[str, int, str, str, float]] = field(default_factory=list)
    # (turn id, session, player line, reply, at)
    session_dates: list[float] = field(default_factory=list)
    questions: list[Question] = field(default_factory=list)
    end: float = START  # when the questions are asked: a day after the last session


def turn_id(session: int, turn: int) -> str:
    return f"D{session + 1}:{turn + 1}"


def date_words(at: float) -> str:
    """'14 March 2027' (UTC), as a person says a date."""
    t = time.gmtime(at)
    return f"{t.tm_mday} {time.strftime('%B', t)} {t.tm_year}"


class _Planter:
    """Free slots of a conversation and the planted lines in them."""

    def __init__(self, rng: random.Random, sessions: int, per_session: int) -> None:
        self.rng, self.sessions = rng, sessions
        self.free = [(s, t) for s in range(sessions) for t in range(per_session)]
        self.lines: dict[tuple[int, int], str] = {}

    def put(self, text: str, lo: int = 0, hi: int | None = None) -> tuple[int, int]:
        hi = self.sessions if hi is None else hi
        slot = self.rng.choice([x for x in self.free if lo <= x[0] < hi])
        self.free.remove(slot)
        self.lines[slot] = text
        return slot


def _q(
    text: str, category: str, slots: list[tuple[int, int]], old: tuple[int, int] | None = None
) -> Question:
    return Question(
        text,
        category,
        tuple(turn_id(*s) for s in slots),
        tuple(sorted({s[0] for s in slots})),
        (turn_id(*old),) if old else (),
    )


def _single(p: _Planter, rng: random.Random) -> list[Question]:
    pet, pet_name = rng.choice(PETS)
    facts = [
        (f"By the way, my sister is called {rng.choice(NAMES)}.", "What is my sister's name?"),
        (f"I work as a {rng.choice(JOBS)} these days.", "What do I do for a living?"),
        (f"We adopted a {pet} named {pet_name} last spring.", f"What did we call the {pet} we adopted?"),
        (f"My birthday is on the {rng.randint(2, 28)}th of {rng.choice(MONTHS)}.", "When is my birthday?"),
        (f"I grew up in {rng.choice(CITIES)}, a long time ago.", "Where was I raised as a child?"),
        (f"Honestly my favourite dish is {rng.choice(FOODS)}.", "Which meal do I love most?"),
    ]
    return [_q(question, "single_hop", [p.put(said)]) for said, question in facts]


def _multi(p: _Planter, rng: random.Random) -> list[Question]:
    friend, boss, city = rng.choice(NAMES), rng.choice(NAMES), rng.choice(CITIES)
    half = max(1, p.sessions // 2)
    a = p.put(f"My best friend since school is {friend}.", 0, half)
    b = p.put(f"{friend} packed up everything and moved to {city} last month.", half)
    c = p.put(f"My new manager at work is called {boss}.", 0, half)
    d = p.put(f"{boss} used to be a professional {rng.choice(JOBS)} before joining us.", half)
    return [
        _q("In which city does my best friend live now?", "multi_hop", [a, b]),
        _q("What did my manager do for a living before?", "multi_hop", [c, d]),
    ]


def _temporal(p: _Planter, rng: random.Random, dates: list[float]) -> list[Question]:
    out = []
    for k, (said, when) in enumerate(rng.sample(EVENTS, 3)):
        slot = p.put(said)
        if k < 2:
            out.append(_q(when, "temporal", [slot]))
        else:
            out.append(_q(f"What did I do on {date_words(dates[slot[0]])}?", "temporal", [slot]))
    return out


def _updates(p: _Planter, rng: random.Random) -> list[Question]:
    city, city2 = rng.sample(CITIES, 2)
    place, place2 = rng.sample(PLACES, 2)
    colour, colour2 = rng.sample(COLOURS, 2)
    half = max(1, p.sessions // 2)
    out = []
    for first, later, question in (
        (
            f"I live in {city} at the moment.",
            f"We finally settled into our new flat in {city2}.",
            "Where do I live?",
        ),
        (
            f"I work at the {place}.",
            f"First week at the {place2} went well, the new colleagues are kind.",
            "Where is my workplace these days?",
        ),
        (
            f"My car is {colour}.",
            f"I had my car repainted {colour2}, it used to be {colour}.",
            "What colour is my car currently?",
        ),
    ):
        old = p.put(first, 0, half)
        new = p.put(later, half)
        out.append(_q(question, "updated_fact", [new], old))
    return out


def _open(p: _Planter, rng: random.Random) -> list[Question]:
    hobby = rng.choice(sorted(HOBBIES))
    allergy = rng.choice(sorted(ALLERGIES))
    a = p.put(f"On weekends I love {hobby} with friends.")
    b = p.put(f"I should tell you I am badly allergic to {allergy}.")
    return [_q(HOBBIES[hobby], "open_domain", [a]), _q(ALLERGIES[allergy], "open_domain", [b])]


def generate(seed: int, sessions: int = 10, per_session: int = 20) -> Dialogue:
    """A seeded conversation of ``sessions`` x ``per_session`` exchanges (at least 4 x 8: the
    plants need 23 slots) with 16 questions, 3 to 6 per category."""
    if sessions < 4 or sessions * per_session < 40:
        raise ValueError(
            f"sessions={sessions}, per_session={per_session}: need >= 4 sessions and >= 40 exchanges"
        )
    rng = random.Random(seed)
    dialogue = Dialogue()
    day = 0.0
    for s in range(sessions):
        day += 0 if s == 0 else rng.randint(1, 10)
        dialogue.session_dates.append(START + day * DAY + rng.randint(9, 19) * 3600)
    p = _Planter(rng, sessions, per_session)
    qs = _single(p, rng) + _multi(p, rng) + _temporal(p, rng, dialogue.session_dates)
    qs += _updates(p, rng) + _open(p, rng)
    dialogue.questions = qs
    for s in range(sessions):
        for t in range(per_session):
            said = p.lines.get((s, t)) or _filler(rng)
            at = dialogue.session_dates[s] + t * 90
            dialogue.exchanges.append((turn_id(s, t), s, said, rng.choice(REPLIES), at))
    dialogue.end = dialogue.session_dates[-1] + DAY
    return dialogue


def _filler(rng: random.Random) -> str:
    template = rng.choice(FILLER)
    name, name2 = rng.sample(NAMES, 2)
    city, city2 = rng.sample(CITIES, 2)
    return template.format(
        adj=rng.choice(ADJECTIVES),
        topic=rng.choice(TOPICS),
        name=name,
        name2=name2,
        city=city,
        city2=city2,
        job=rng.choice(JOBS),
        pet=rng.choice(PETS)[0],
        food=rng.choice(FOODS),
        hobby=rng.choice(sorted(HOBBIES)),
        colour=rng.choice(COLOURS),
        place=rng.choice(PLACES),
        allergy=rng.choice(sorted(ALLERGIES)),
    )
