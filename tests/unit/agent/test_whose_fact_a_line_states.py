"""A question about the player ranks the player's own facts above the same facts said of other
people (agent/subjects.py, SearchWeights.other), and changes nothing for a question about no one
in particular. The search tests use the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

import time

import pytest

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.crystals import CrystalSpec
from nimmer_train.agent.ingestion import Exchange, index_exchanges
from nimmer_train.agent.search import SearchWeights
from nimmer_train.agent.subjects import (
    PLAYER_SELF,
    Subject,
    about_another,
    asked_about,
    player_said,
    said_about,
)
from nimmer_train.memory.embedding import SentenceEmbedder

FRIEND = Subject("relation", frozenset({"friend"}))


def relation(*who: str) -> Subject:
    return Subject("relation", frozenset(who))


@pytest.mark.parametrize(
    ("line", "subject"),
    [
        ("We finally settled into our new flat in Turin.", PLAYER_SELF),
        ("My friend and I went sailing.", PLAYER_SELF),
        ("Me and my wife finally settled into our new flat in Oslo.", PLAYER_SELF),
        ("My boss promoted me to head baker.", PLAYER_SELF),  # the player is in it: the player's fact
        ("Love falafel, my favourite dish by far.", PLAYER_SELF),  # no subject, but "my" of a thing
        ("My mum's falafel is still my favourite dish.", PLAYER_SELF),
        ("I\u2019m a nurse now.", PLAYER_SELF),  # a curly apostrophe
        ("i live in turin now", PLAYER_SELF),  # chat in lower case
        ("My friend Vera lives in Ghent and works as a baker.", FRIEND),
        ("Our neighbor Hugo is allergic to cats.", relation("neighbour")),  # one word per relation
        ("My colleague Birk has a sister called Greta.", relation("colleague")),
        ("My parents Ann and Bo, my sister Lea and her kids live in Oslo.", relation("parent", "sister")),
        ("My hubby Tom works nights at the depot.", relation("husband")),
        # a relation that does not open a clause: the player's own doing, not the relation's
        ("Went hiking in the hills with my brother on Saturday.", PLAYER_SELF),
        ("Started working at my uncle's bakery on Monday.", PLAYER_SELF),
        # an unnamed relation as the subject tells the player's news (a second review's cases)
        ("My boss confirmed the promotion this morning!", PLAYER_SELF),
        ("Our landlord put the rent up to 1,400 a month.", PLAYER_SELF),
        ("My friend Ada flew to the US last week.", FRIEND),  # the country is not "us"
        # the player does not appear: nothing is guessed (a review showed guessed names and "you"
        # demoting the player's own "Got a job as a nurse" and "moved here, you should visit!")
        ("Greta just started a new job at the harbour office.", None),
        ("Got a job as a nurse, that keeps me busy.", PLAYER_SELF),
        ("Got the keys to the new flat at last.", None),
        ("Do you think it will rain on the weekend?", None),
    ],
)
def test_a_player_line_is_read_as_the_fact_of_whom_it_is_about(line: str, subject: Subject | None) -> None:
    assert said_about(line) == subject


@pytest.mark.parametrize(
    ("question", "subject"),
    [
        ("Where do I live?", PLAYER_SELF),
        ("where do i live", PLAYER_SELF),
        ("Is satay sauce a safe choice for me?", PLAYER_SELF),
        ("What colour is my car currently?", PLAYER_SELF),
        ("What is my sister's name?", relation("sister")),
        ("What does my mom do for work?", relation("mother")),  # mum, mom and mother are one
        ("What does my hubby do?", relation("husband")),
        ("In which city does my best friend live now?", FRIEND),
        ("When did Caroline go to the support group?", None),  # third person: asks about no one here
        ("When did Caroline fly back from the US?", None),
    ],
)
def test_a_question_is_read_as_asking_about_the_player_a_relation_or_no_one(
    question: str, subject: Subject | None
) -> None:
    assert asked_about(question) == subject


def test_only_a_line_about_other_relations_counts_against_a_question() -> None:
    sister, parents_and_sister = relation("sister"), relation("parent", "sister")
    assert about_another(PLAYER_SELF, FRIEND) and about_another(sister, FRIEND)
    assert not about_another(PLAYER_SELF, PLAYER_SELF) and not about_another(PLAYER_SELF, None)
    assert not about_another(sister, sister) and not about_another(sister, parents_and_sister)
    assert not about_another(sister, PLAYER_SELF) and not about_another(FRIEND, None)
    assert not about_another(None, FRIEND), "a question about no one in particular changes nothing"


def test_every_line_of_the_players_message_is_read_and_nothing_else() -> None:
    text = (
        "player: Big news!\nI baked bread today.\nnpc:companion: You told me about Oslo.\n"
        "player (continued): Since May."
    )
    assert player_said(text) == "Big news!\nI baked bread today.\nSince May."
    assert player_said("user: I live in Turin.\nassistant: Noted.") == "I live in Turin."  # over MCP
    assert player_said("# A note\nMy friend Vera lives in Ghent.") == ""


DAY = 86400.0
OTHERS = [
    f"My friend {n} lives in {c} and works as a baker."
    for n, c in zip(
        ["Vera", "Lena", "Emil", "Nora", "Birk"], ["Ghent", "Porto", "Vienna", "Riga", "Lyon"], strict=True
    )
]
OTHERS += ["My colleague Karl moved into a new flat in Turin.", "Our neighbour Greta lives in Bergen now."]
OTHERS += ["Do you think it will rain on the weekend?", "Have you heard the news about bees?"]  # left alone
MINE = "We finally settled into our new flat in Turin."


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> AgentMemory:
    start = time.time() - 30 * DAY
    agent = AgentMemory(tmp_path_factory.mktemp("whose"), SentenceEmbedder(), clock=lambda: start + 30 * DAY)
    said = [*OTHERS[:4], MINE, *OTHERS[4:]]
    index_exchanges(
        agent,
        [
            Exchange(
                f"session-{n}", (f"t{n}",), (("player", line), ("npc:companion", "Noted!")), start + n * DAY
            )
            for n, line in enumerate(said)
        ],
    )
    yield agent
    agent.close()


def _place(agent: AgentMemory, question: str, other: float) -> tuple[int, list[tuple[str, float]]]:
    agent.weights = SearchWeights(other=other)
    hits = agent.memory_search(question, 11, -1.0, record_access=False)
    texts = [player_said(str(hit["text"])) for hit in hits]
    return texts.index(MINE), [(str(hit["session_id"]), float(hit["score"])) for hit in hits]


def test_a_question_about_the_player_ranks_the_players_own_fact_above_the_same_fact_of_others(
    memory: AgentMemory,
) -> None:
    with_rule, _ = _place(memory, "Where do I live?", SearchWeights().other)
    without, _ = _place(memory, "Where do I live?", 0.0)
    assert with_rule == 0, f"the player's own move ranked {with_rule + 1}"
    assert without > with_rule, "without the rule the friends' homes rank above it (the test can fail)"


def test_a_question_about_no_one_in_particular_ranks_exactly_as_before(memory: AgentMemory) -> None:
    assert _place(memory, "Which city has a new flat?", SearchWeights().other) == _place(
        memory, "Which city has a new flat?", 0.0
    )


def test_a_note_that_quotes_a_player_line_is_never_demoted(memory: AgentMemory) -> None:
    """Only exchange crystals are read: a note or a file quoting "player: ..." is left alone."""
    memory.add([CrystalSpec("player: My friend Ada lives in a flat in Turin.", "note")])
    ranked = {other: _place(memory, "Where do I live?", other)[1] for other in (SearchWeights().other, 0.0)}
    note = [dict(hits) for hits in ranked.values()]
    assert note[0]["None"] == note[1]["None"], "the note's score is the same with the rule and without"


def test_a_message_is_someone_elses_only_when_every_sentence_of_it_is() -> None:
    news = "My sister Ana is visiting next week. Oh and got the job at the bank, start Monday!"
    assert said_about(news) is None, "the player's news in the second sentence keeps the message"
    assert said_about("My sister Ana is visiting next week\ngot the job at the bank") is None  # no stop
    assert said_about("My friend Vera lives in Ghent. My colleague Ada lives in Oslo.") == relation(
        "friend", "colleague"
    )


@pytest.mark.parametrize(
    ("question", "line"),
    [
        ("Where does my mum live?", "My parents Ana and Jo live in Porto."),
        ("What do my grandparents do?", "My grandma Rose still runs the farm."),
        ("Who in my family is allergic to cats?", "My brother Marc is allergic to cats."),
        ("Which of my relatives lives abroad?", "My aunt Carla lives in Buenos Aires."),
        ("Did my boss approve my leave?", "My manager Karl approved the leave."),
        ("What does my partner do?", "My wife Lea teaches maths."),
    ],
)
def test_a_relation_is_answered_by_its_members_and_its_other_names(question: str, line: str) -> None:
    assert not about_another(asked_about(question), said_about(line))


def test_a_different_member_of_the_family_is_still_someone_else() -> None:
    assert about_another(
        asked_about("What is my sister's name?"), said_about("My brother Marc is a dentist.")
    )
