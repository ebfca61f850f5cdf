"""A question about the player ranks the player's own facts above the same facts said of other
people (agent/subjects.py, SearchWeights.other), and changes nothing for a question about no one
in particular. The search tests use the packaged all-MiniLM-L6-v2."""

from __future__ import annotations

import time

import pytest

from nimmer_train.agent.agent_memory import AgentMemory
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

FRIEND = Subject("relation", "friend")


@pytest.mark.parametrize(
    ("line", "subject"),
    [
        ("We finally settled into our new flat in Turin.", PLAYER_SELF),
        ("My friend and I went sailing.", PLAYER_SELF),
        ("I\u2019m a nurse now.", PLAYER_SELF),  # a curly apostrophe
        ("i live in turin now", PLAYER_SELF),  # chat in lower case
        ("My friend Vera lives in Ghent and works as a baker.", FRIEND),
        ("Our new neighbour is allergic to cats.", Subject("relation", "neighbour")),
        ("My colleague Birk has a sister called Greta.", Subject("relation", "colleague")),
        ("Do you think it will rain on the weekend?", Subject("listener")),
        ("Greta just started a new job at the harbour office.", Subject("named", "Greta")),
        ("Moved to Turin last week.", None),  # no subject said: a verb's shape is not a name
        ("First week at the river school went well, the new colleagues are kind.", None),
        ("My car is red.", None),  # "my" of a thing, not of a person
    ],
)
def test_a_player_line_is_read_as_the_fact_of_whom_it_is_about(line: str, subject: Subject | None) -> None:
    assert said_about(line) == subject


@pytest.mark.parametrize(
    ("question", "subject"),
    [
        ("Where do I live?", PLAYER_SELF),
        ("Is satay sauce a safe choice for me?", PLAYER_SELF),
        ("What colour is my car currently?", PLAYER_SELF),
        ("What is my sister's name?", Subject("relation", "sister")),
        ("In which city does my best friend live now?", FRIEND),
        ("When did Caroline go to the support group?", None),  # third person: asks about no one here
    ],
)
def test_a_question_is_read_as_asking_about_the_player_a_relation_or_no_one(
    question: str, subject: Subject | None
) -> None:
    assert asked_about(question) == subject


def test_only_someone_elses_fact_counts_against_a_question_and_a_named_second_hop_never_does() -> None:
    named, listener = Subject("named", "Tomas"), Subject("listener")
    assert about_another(PLAYER_SELF, FRIEND) and about_another(PLAYER_SELF, named)
    assert about_another(PLAYER_SELF, listener)
    assert not about_another(PLAYER_SELF, PLAYER_SELF) and not about_another(PLAYER_SELF, None)
    sister = Subject("relation", "sister")
    assert about_another(sister, FRIEND) and about_another(sister, listener)
    assert not about_another(sister, sister)
    assert not about_another(FRIEND, named), (
        "'Tomas moved to Oslo' may answer 'where does my best friend live?'"
    )
    assert not about_another(None, FRIEND), "a question about no one in particular changes nothing"


def test_only_the_players_lines_of_a_crystal_are_read() -> None:
    text = "player: I live in Turin.\nnpc:companion: You told me about Oslo.\nplayer (continued): Since May."
    assert player_said(text) == "I live in Turin. Since May."
    assert player_said("# A note\nMy friend Vera lives in Ghent.") == ""


DAY = 86400.0
OTHERS = [
    f"My friend {n} lives in {c} and works as a baker."
    for n, c in zip(
        ["Vera", "Lena", "Emil", "Nora", "Birk"], ["Ghent", "Porto", "Vienna", "Riga", "Lyon"], strict=True
    )
]
OTHERS += [
    f"{n} just started a new job at the {p}."
    for n, p in (("Greta", "harbour office"), ("Karl", "city hospital"))
]
OTHERS += ["Do you think it will rain on the weekend?", "Have you heard the news about bees?"]
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
    with_rule, _ = _place(memory, "Where do I live?", 8.0)
    without, _ = _place(memory, "Where do I live?", 0.0)
    assert with_rule == 0, f"the player's own move ranked {with_rule + 1}"
    assert without > with_rule, "without the rule the friends' homes rank above it (the test can fail)"


def test_a_question_about_no_one_in_particular_ranks_exactly_as_before(memory: AgentMemory) -> None:
    assert _place(memory, "Which city has a new flat?", 8.0) == _place(
        memory, "Which city has a new flat?", 0.0
    )
