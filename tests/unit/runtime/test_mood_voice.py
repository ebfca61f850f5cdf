"""Mood reaches the voice (issue 17), end to end through NpcRuntime.speak on Ring A over a tiny
signed version published here (tests/helpers/published.py): a reward raises the NPC's energy and
its next turn's temperature, inside the register's affect band; hours of game time later both are
back at rest, and the turn is spoken exactly as by an NPC without hormones. The tone hints join
the prompt's memory scope without naming the emotion."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimmer_train.agent.hormones import REST_TONE, Hormones
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA
from nimmer_train.runtime.turn import NpcRuntime, TurnRequest
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import shape_knobs
from tests.helpers.memory import Clock
from tests.helpers.published import publish_registers

CATALOGUE = load_catalogue()
REGISTER = "caste-preacher"
PROFILE = CATALOGUE.get(REGISTER).traits
T0 = 1_800_000_000.0
EMOTION_WORDS = ("dopamine", "cortisol", "oxytocin", "happy", "elated", "content", "you feel", "stress")


class RecordingRing(RingA):
    """Ring A that keeps the prompts it was given (to read the memory scope the model saw)."""

    def __init__(self, model: LocalModel) -> None:
        super().__init__(model)
        self.prompts: list[list[dict[str, str]]] = []

    def speak(self, prompt, register, name, knobs):  # noqa: ANN001, ANN201
        self.prompts.append(self.render(prompt, register))
        return super().speak(prompt, register, name, knobs)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalModel]:
    releases, trusted = publish_registers(tmp_path_factory.mktemp("published"), (REGISTER,))
    m = LocalModel.open(releases, "v1", trusted)
    yield m
    m.close()


def _request(utterance: str = "What news from the lower ring?", **kw: object) -> TurnRequest:
    return TurnRequest(
        npc="mira",
        gesture=PROFILE,
        player_utterance=utterance,
        turn_intent="answer the player",
        zone_context="the chapel steps at noon",
        **kw,
    )


def test_a_reward_warms_the_next_turn_and_hours_later_it_is_at_rest(
    model: LocalModel, tmp_path: Path
) -> None:
    clock = Clock(T0)
    hormones = Hormones(tmp_path / "mira", clock)
    ring = RecordingRing(model)
    runtime = NpcRuntime(
        CATALOGUE, {"casual": ring}, registers=[REGISTER], max_new_tokens=48, hormones={"mira": hormones}
    )
    rest = shape_knobs(CATALOGUE, REGISTER, PROFILE, 0.5, 0.0, max_new_tokens=48).knobs.as_dict()
    high = 1.2 * rest["temperature"]  # the top of the register's affect band (x0.8 .. x1.2)

    before = runtime.speak(_request())
    assert before.knobs == rest  # at rest: exactly the knobs of an NPC without hormones
    assert not any("(tone)" in m["content"] for m in ring.prompts[-1])

    clock.now += 60  # a game event: the player pays the preacher
    after = runtime.speak(_request("Here, for the chapel.", events=("reward",)))
    energy = hormones.state()["tone"]["energy"]
    assert energy == pytest.approx(1.5 * 0.45) and energy > REST_TONE["energy"]
    assert rest["temperature"] < after.knobs["temperature"] <= high
    arousal = 0.5 + 0.6 * (energy - REST_TONE["energy"])  # affect_shift: energy arouses
    assert after.knobs["temperature"] == pytest.approx(
        round(rest["temperature"] * (1 + 0.4 * (arousal - 0.5)), 4)
    )
    assert after.knobs["top_p"] > rest["top_p"]
    system = ring.prompts[-1][0]["content"]
    assert "(tone) be enthusiastic and celebrate wins" in system  # guidance joined the memory scope
    assert not any(word in system.lower() for word in EMOTION_WORDS)  # the emotion is not announced
    affect = json.loads(system)["affect_state"]
    assert affect["mood"] == "calm" and affect["arousal"] == pytest.approx(arousal)

    clock.now += 8 * 3600  # hours of game time later
    later = runtime.speak(_request())
    assert hormones.state()["tone"]["energy"] == pytest.approx(REST_TONE["energy"], abs=1e-4)
    assert later.knobs == rest
    assert not any("(tone)" in m["content"] for m in ring.prompts[-1])
    hormones.close()


def test_capped_hormones_keep_the_knobs_inside_the_register_band(model: LocalModel, tmp_path: Path) -> None:
    clock = Clock(T0)
    hormones = Hormones(tmp_path / "mira", clock)
    runtime = NpcRuntime(
        CATALOGUE,
        {"casual": RingA(model)},
        registers=[REGISTER],
        max_new_tokens=48,
        hormones={"mira": hormones},
    )
    rest = shape_knobs(CATALOGUE, REGISTER, PROFILE, 0.5, 0.0).knobs
    events = ("achievement", "reward", "urgency", "error") * 4
    turn = runtime.speak(_request("Hurry, the gate! We did it, thank you friend!", events=events))
    assert max(hormones.levels().values()) == 1.0  # capped
    assert 0.8 * rest.temperature <= turn.knobs["temperature"] <= 1.2 * rest.temperature
    assert turn.knobs["repetition_penalty"] >= rest.repetition_penalty  # cortisol distresses
    with pytest.raises(Exception, match="'bribe' is not one of"):
        runtime.speak(_request(events=("bribe",)))  # refused before anything is generated
    hormones.close()
