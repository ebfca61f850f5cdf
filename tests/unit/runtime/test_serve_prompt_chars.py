"""``nimmer serve`` refuses a prompt longer in characters than its context could hold before it
tokenizes it: tokenizing runs on the one preparation thread, so ten 1 MiB prompts used to hold
every request behind them for seconds. The server is the real one on loopback over the recording
stand-in engine of test_serve_limits.py, whose tokenizer here costs what a real one does per byte
and counts its calls."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from nimmer_train.runtime.openai_server import create_app
from nimmer_train.runtime.request_limits import ServeLimits
from tests.helpers.loopback import serve_app
from tests.unit.runtime.test_serve_limits import LABEL, StandInEngine

SECONDS_PER_MIB = 0.5  # about what a real tokenizer and chat template take per MiB of text
HUGE = "a" * (2**20 - 200)  # one word: a body just under the 1 MiB cap


class PricedTokenizer(StandInEngine):
    """The stand-in engine whose tokenizer takes time in proportion to the text and counts calls."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenized: list[int] = []  # characters per tokenizer call
        self.lock = threading.Lock()

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> list[int]:
        chars = sum(len(m["content"]) for m in messages)
        with self.lock:
            self.tokenized.append(chars)
        time.sleep(SECONDS_PER_MIB * chars / 2**20)
        return super().apply_chat_template(messages, **kw)


@pytest.fixture
def served() -> Iterator[tuple[str, PricedTokenizer]]:
    engine = PricedTokenizer()
    with serve_app(create_app(engine)) as url:  # type: ignore[arg-type]
        yield url, engine


def _chat(content: str) -> dict[str, Any]:
    return {"model": LABEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}


def test_a_prompt_longer_than_the_context_can_hold_is_refused_untokenized(
    served: tuple[str, PricedTokenizer],
) -> None:
    url, engine = served
    reply = httpx.post(f"{url}/v1/chat/completions", json=_chat(HUGE), timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    limit = ServeLimits().max_chars_per_token * engine.context_tokens
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error
    assert f"{len(HUGE)} characters" in error["message"] and f"{limit}" in error["message"], error
    assert engine.tokenized == [] and engine.calls == []  # never tokenized, never prepared
    # at the limit it is tokenized and counted as before (one word here: a short prompt)
    assert httpx.post(f"{url}/v1/chat/completions", json=_chat("a" * limit), timeout=30).status_code == 200
    assert engine.tokenized == [limit]


def test_a_small_request_behind_ten_huge_prompts_is_not_held(served: tuple[str, PricedTokenizer]) -> None:
    url, engine = served
    with httpx.Client(base_url=url, timeout=60) as client, ThreadPoolExecutor(11) as pool:
        huge = [pool.submit(client.post, "/v1/chat/completions", json=_chat(HUGE)) for _ in range(10)]
        time.sleep(0.2)  # the huge ones reach the preparation thread first
        started = time.perf_counter()
        small = client.post("/v1/chat/completions", json=_chat("Speak, citizen."))
        waited = time.perf_counter() - started
        statuses = [f.result().status_code for f in huge]
    assert small.status_code == 200
    # ten tokenized would hold it about 10 * SECONDS_PER_MIB = 5 s
    assert waited < 3 * SECONDS_PER_MIB, f"the small request waited {waited:.2f} s"
    assert statuses == [400] * 10
    assert engine.tokenized == [len("Speak, citizen.")]
