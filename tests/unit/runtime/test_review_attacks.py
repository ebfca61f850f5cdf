"""Exploit tests from an adversarial review of ``nimmer serve``'s request checks (issue 21,
item 9): requests that still reached a 500 after the hardening, sent on loopback to a real
server over a stand-in engine (and, marked slow, over the tiny published model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.openai_server import create_app
from tests.helpers.loopback import serve_app
from tests.unit.runtime.test_serve_limits import LABEL, StandInEngine

SURROGATE = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _chat(model: str = LABEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Speak."}], **extra}


class Utf8Engine(StandInEngine):
    """The stand-in with a tokenizer that, like every Hugging Face tokenizer, takes UTF-8 text."""

    def apply_chat_template(self, messages: list[dict[str, str]], **kw: Any) -> list[int]:
        for m in messages:
            m["content"].encode("utf-8")
        return super().apply_chat_template(messages, **kw)


@pytest.fixture
def server() -> Iterator[tuple[httpx.Client, StandInEngine]]:
    engine = Utf8Engine()
    with serve_app(create_app(engine)) as url:  # type: ignore[arg-type]
        yield httpx.Client(base_url=url, timeout=30), engine


def _assert_400(reply: httpx.Response, *words: str) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert all(w in error["message"] for w in words), error
    return error


# integers past 64 bits in a schema: the grammar compiler raises ValueError (it does not return
# an error), which escaped the schema cache as a 500
BIG_SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer", "maximum": 10**300}}},
    {"type": "object", "properties": {"a": {"type": "string", "minLength": 10**20}}},
    {"type": "array", "minItems": 2**64},
    {"type": "object", "properties": {"a": {"enum": [10**40]}}},
]


@pytest.mark.parametrize("schema", BIG_SCHEMAS)
def test_a_schema_the_compiler_raises_on_is_a_400(
    server: tuple[httpx.Client, StandInEngine], schema: dict[str, Any]
) -> None:
    client, engine = server
    reply = client.post("/v1/chat/completions", json=_chat(response_format=_fmt(schema)))
    error = _assert_400(reply, "cannot be compiled")
    assert error["param"] == "response_format" and engine.calls == []


def test_a_lone_surrogate_is_a_400_not_a_500(server: tuple[httpx.Client, StandInEngine]) -> None:
    """``\\ud800`` is valid JSON but not Unicode text: Python's json accepts it, the tokenizer
    raised inside the request check (500). In content, in a schema, anywhere: 400 invalid_json."""
    client, engine = server
    reply = client.post("/v1/chat/completions", content=SURROGATE % LABEL.encode())
    assert _assert_400(reply, "surrogate")["code"] == "invalid_json"
    schema = b'{"type": "object", "properties": {"a": {"enum": ["\\udfff"]}}}'
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "response_format": ' % (
        LABEL.encode()
    )
    body += b'{"type": "json_schema", "json_schema": {"schema": ' + schema + b"}}}"
    _assert_400(client.post("/v1/chat/completions", content=body), "surrogate")
    assert engine.calls == []
    # an escaped surrogate *pair* is one real character and stays fine
    pair = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud83d\\ude00"}]}'
    assert client.post("/v1/chat/completions", content=pair % LABEL.encode()).status_code == 200


@pytest.fixture(scope="module")
def tiny_model(tiny_run: Path) -> LocalModel:
    return LocalModel.open(tiny_run / "releases", "v1", tiny_run / "keys" / "trusted")


@pytest.mark.slow
def test_the_real_engine_answers_400_to_both(tiny_model: LocalModel) -> None:
    with serve_app(create_app(tiny_model)) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", content=SURROGATE % tiny_model.label.encode())
        _assert_400(reply, "surrogate")
        body = _chat(tiny_model.label, response_format=_fmt(BIG_SCHEMAS[0]))
        _assert_400(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60), "cannot be compiled")
        ok = httpx.post(f"{url}/v1/chat/completions", json=_chat(tiny_model.label, max_tokens=4), timeout=60)
        assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] <= 4
