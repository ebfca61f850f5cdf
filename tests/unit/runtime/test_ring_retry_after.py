"""A remote ring's ``Retry-After`` is honoured only within the turn's deadline: a server that asks
a turn to wait about three years (or until 2100) gets no second request and the turn ends at once
with an error reply; a malformed value is ignored (backoff instead), never raised. Against the
loopback stand-in for an OpenAI-compatible provider and a vLLM farm (tests/helpers/llm_server.py:
third parties we cannot run here), with real HTTP."""

from __future__ import annotations

import json
import threading
import time

import pytest

from nimmer_train.runtime.rings import Ring, RingB, RingC, RingConfig
from nimmer_train.runtime.turn import NpcRuntime, TurnError, TurnRequest
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.llm_server import serve

CATALOGUE = load_catalogue()
THREE_YEARS = "94608000"
TOO_LATE = "Fri, 31 Dec 2100 23:59:59 GMT"
GUARD_S = 30  # a hang guard: the unfixed ring slept for the Retry-After (about 1,095 days)


def _request() -> TurnRequest:
    return TurnRequest(
        npc="oran",
        gesture=CATALOGUE.get("drunk-scavenger").traits,
        player_utterance="Where did the water go?",
        turn_intent="answer the player",
        zone_context="the scrap fields at dusk",
        tier="deep",
    )


def _turn(ring: Ring) -> tuple[BaseException | None, float]:
    """What the turn raised (None: it spoke) and how long it took, run on a thread so that a ring
    that sleeps as told fails the test instead of hanging it."""
    outcome: list[BaseException | None] = []

    def run() -> None:
        try:
            NpcRuntime(CATALOGUE, {"deep": ring}).speak(_request())
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    started = time.monotonic()
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(GUARD_S)
    assert not worker.is_alive(), f"the turn still waits after {GUARD_S} s (it slept as told)"
    return outcome[0], time.monotonic() - started


def _ring_c(url: str, **changes: object) -> RingC:
    return RingC(
        RingConfig(ring="C", base_url=f"{url}/v1", model="gpt-x", api_key_env="PLAYER_KEY", **changes)
    )


@pytest.fixture(autouse=True)
def player_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAYER_KEY", "sk-player")


@pytest.mark.parametrize("retry_after", [THREE_YEARS, TOO_LATE])
def test_a_retry_after_past_the_turns_deadline_ends_the_turn_at_once(retry_after: str) -> None:
    answer = lambda body: json.dumps({"utterance": "Too late."})  # noqa: E731
    with serve(answer) as server:
        server.script = [(429, {"Retry-After": retry_after}, '{"error": "slow down"}')]
        error, seconds = _turn(_ring_c(server.url))
        assert isinstance(error, TurnError) and error.kind == "http_429_past_deadline", error
        assert len(server.requests) == 1 and seconds < 10  # no second request, no wait


def test_ring_b_keeps_the_same_deadline() -> None:
    answer = lambda body: json.dumps({"utterance": "Too late."})  # noqa: E731
    with serve(answer, models=["v1", "v1:drunk-scavenger"]) as farm:
        farm.script = [(429, {"Retry-After": THREE_YEARS}, '{"error": "busy"}')]
        error, seconds = _turn(RingB(RingConfig(ring="B", base_url=f"{farm.url}/v1")))
        assert isinstance(error, TurnError) and error.kind == "http_429_past_deadline", error
        assert len(farm.requests) == 1 and seconds < 10


def test_a_wait_within_the_deadline_is_still_honoured() -> None:
    answer = lambda body: json.dumps({"utterance": "Now, then."})  # noqa: E731
    with serve(answer) as server:
        server.script = [(429, {"Retry-After": "1"}, '{"error": "slow down"}')]
        error, seconds = _turn(_ring_c(server.url, deadline_s=5.0))
        assert error is None and len(server.requests) == 2 and seconds >= 1.0
        server.script = [(429, {"Retry-After": "6"}, '{"error": "slow down"}')]  # past 5 s
        error, _ = _turn(_ring_c(server.url, deadline_s=5.0))
        assert isinstance(error, TurnError) and error.kind == "http_429_past_deadline", error


@pytest.mark.parametrize("retry_after", ["garbage", "inf", "1e400", "Fri, 99 Foo 2100 99:99:99 GMT"])
def test_a_malformed_retry_after_is_an_error_reply_not_a_crash(retry_after: str) -> None:
    answer = lambda body: json.dumps({"utterance": "Never mind."})  # noqa: E731
    with serve(answer) as server:
        server.script = [(429, {"Retry-After": retry_after}, '{"error": "slow down"}')] * 2
        error, seconds = _turn(_ring_c(server.url, max_retries=1))  # one backoff, then give up
        assert isinstance(error, TurnError) and error.kind == "http_429", error
        assert len(server.requests) == 2 and seconds < 10
