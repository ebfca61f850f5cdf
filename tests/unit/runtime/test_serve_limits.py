"""Exploit tests for ``nimmer serve`` (issue 21, items 8-9): each sends the request a review used
against a real server on loopback and shows it is now refused or bounded. The limits live in
runtime/request_limits.py, before the engine: most tests run the server over a recording stand-in
engine (fast, and the limits must hold whatever the engine); the last runs the tiny published
model itself. The follow-up review's requests that still reached a 500 (a schema the grammar
compiler raises on, a lone surrogate) are among the malformed ones."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from nimmer_train.cli.serve import serve_api_key
from nimmer_train.errors import NimmerError
from nimmer_train.runtime.engine import Done, Job
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.openai_server import create_app
from nimmer_train.runtime.request_limits import ServeLimits
from nimmer_train.runtime.serve_metrics import ServeMetrics
from nimmer_train.voice.sampling import SamplingKnobs
from tests.helpers.loopback import serve_app

LABEL = "nimmerworld-base-v1"
SCHEMA = {"type": "object", "properties": {"line": {"type": "string"}}, "required": ["line"]}
SURROGATE = b'{"model": "%s", "messages": [{"role": "user", "content": "hi \\ud800 there"}]}'


class StandInEngine:
    """What the server needs of a model: a label, LoRAs, a context, a tokenizer, ``prepare`` and
    an ``engine`` to submit to. One token per word; like every Hugging Face tokenizer it takes
    UTF-8 text; it records what it was asked to do and answers each job at once."""

    label, registers, context_tokens = LABEL, ["drunk-scavenger"], 512

    def __init__(self) -> None:
        self.calls: list[tuple[SamplingKnobs, Any, Any]] = []
        self.tokenizer = self
        self.engine = self
        self.alive, self.closing, self.rows, self.waiting = True, False, [], []
        self.metrics = ServeMetrics()

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> list[int]:
        for m in messages:
            m["content"].encode("utf-8")
        return [0] * sum(len(m["content"].split()) + 4 for m in messages)

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        return self.apply_chat_template(messages)

    def prepare(
        self, messages: list, register: Any, knobs: SamplingKnobs, schema: Any, seed: Any, **kw: Any
    ) -> Job:
        self.calls.append((knobs, schema, seed))
        ids = kw.get("prompt") or self.prompt_ids(messages)
        return Job(ids, register, knobs, [seed or 0] * kw.get("n", 1), [None], kw["sink"])

    max_batch = 16

    def room(self) -> int:  # it answers at once: always room
        return 64

    def retry_after_s(self) -> int:
        return 1

    def submit(self, job: Job) -> Job:
        for i in range(job.n):
            job.sink(Done(i, "length", '{"line": "x"}', job.knobs.max_new_tokens, None))
        return job


@pytest.fixture
def server() -> Iterator[tuple[httpx.Client, StandInEngine]]:
    engine = StandInEngine()
    with serve_app(create_app(engine)) as url:  # type: ignore[arg-type]
        yield httpx.Client(base_url=url, timeout=30), engine


def _chat(model: str = LABEL, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "Speak."}], **extra}


def _refused(response: httpx.Response, status: int, param: str | None, *words: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"], error
    assert all(w in error["message"] for w in words), error["message"]


def _fmt(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _assert_400(reply: httpx.Response, *words: str) -> dict[str, Any]:
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert all(w in error["message"] for w in words), error
    return error


# 8. resource limits


def test_max_tokens_is_clamped_to_the_context_left(server: tuple[httpx.Client, StandInEngine]) -> None:
    client, engine = server
    long_schema = {"type": "object", "properties": {"line": {"type": "string", "minLength": 3900}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": long_schema}}
    reply = client.post("/v1/chat/completions", json=_chat(max_tokens=4000, response_format=fmt))
    assert reply.status_code == 200
    knobs, _, _ = engine.calls[-1]
    prompt = reply.json()["usage"]["prompt_tokens"]
    assert knobs.max_new_tokens == 512 - prompt and reply.json()["choices"][0]["finish_reason"] == "length"
    client.post("/v1/chat/completions", json=_chat())
    assert engine.calls[-1][0].max_new_tokens == 256  # the default, within the context
    # a prompt over the context: 400 naming both numbers, the engine never called
    calls = len(engine.calls)
    huge = _chat(messages=[{"role": "user", "content": "a " * 1000}])  # within the characters' cap
    _refused(client.post("/v1/chat/completions", json=huge), 400, "messages", "1004 tokens", "512 tokens")
    assert len(engine.calls) == calls


def test_bodies_and_schemas_are_size_capped(server: tuple[httpx.Client, StandInEngine]) -> None:
    client, engine = server
    big = client.post("/v1/chat/completions", content=b'{"model": "' + b"x" * (30 * 2**20) + b'"}')
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    props = {f"p{i}": {"type": "string", "description": "y" * 100} for i in range(6000)}  # ~0.8 MB
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": props}}}
    _refused(
        client.post("/v1/chat/completions", json=_chat(response_format=fmt)),
        400,
        "response_format.json_schema.schema",
        "limit is 16384",
    )
    deep: dict[str, Any] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    fmt = {"type": "json_schema", "json_schema": {"schema": deep}}
    _refused(
        client.post("/v1/chat/completions", json=_chat(response_format=fmt)),
        400,
        "response_format.json_schema.schema",
        "deeper",
    )
    nested = b"[" * 100_000 + b"]" * 100_000  # deep JSON: no RecursionError 500
    assert client.post("/v1/chat/completions", content=nested).status_code in (400, 413)
    assert engine.calls == []


def test_only_schemas_that_compile_are_cached_and_the_cache_is_bounded() -> None:
    engine = StandInEngine()
    app = create_app(engine, limits=ServeLimits(schema_cache_size=4))  # type: ignore[arg-type]
    cache = app.state.schemas
    with serve_app(app) as url:
        for i in range(10):
            schema = {"type": "object", "properties": {f"k{i}": {"type": "string"}}}
            fmt = {"type": "json_schema", "json_schema": {"schema": schema}}
            assert (
                httpx.post(f"{url}/v1/chat/completions", json=_chat(response_format=fmt)).status_code == 200
            )
        assert len(cache.known) == 4  # bounded: the least recently used were dropped
        known = dict(cache.known)
        for bad in (
            {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)a"}}},
            {"type": "object", "properties": {"a": {"$ref": "#/nope"}}},
        ):
            fmt = {"type": "json_schema", "json_schema": {"schema": bad}}
            reply = httpx.post(f"{url}/v1/chat/completions", json=_chat(response_format=fmt))
            _refused(reply, 400, "response_format", "cannot be compiled")
        assert dict(cache.known) == known  # a schema that does not compile is never remembered
    assert len(engine.calls) == 10  # ... and never reaches the engine


def test_bearer_token_auth(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = StandInEngine()
    with serve_app(create_app(engine, api_key="k" * 32)) as url:  # type: ignore[arg-type]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "k" * 32}):
            reply = httpx.post(f"{url}/v1/chat/completions", json=_chat(), headers=headers)
            assert reply.status_code == 401 and reply.json()["error"]["code"] == "invalid_api_key"
            assert httpx.get(f"{url}/v1/models", headers=headers).status_code == 401
        ok = httpx.post(
            f"{url}/v1/chat/completions", json=_chat(), headers={"Authorization": "Bearer " + "k" * 32}
        )
        assert ok.status_code == 200 and len(engine.calls) == 1
    # the CLI refuses to bind beyond loopback without a token, and a short token
    with pytest.raises(NimmerError, match="beyond loopback"):
        serve_api_key("0.0.0.0", None)
    monkeypatch.setenv("SERVE_KEY", "short")
    with pytest.raises(NimmerError, match="shorter than 16"):
        serve_api_key("0.0.0.0", "SERVE_KEY")
    monkeypatch.setenv("SERVE_KEY", "k" * 32)
    assert serve_api_key("0.0.0.0", "SERVE_KEY") == "k" * 32 and serve_api_key("127.0.0.1", None) is None


# 9. malformed requests: OpenAI-style 400s naming the field


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([{"model": LABEL}], None),
        (_chat(messages=[{"role": "user", "content": {"text": "hi"}}]), "messages[0].content"),
        (_chat(messages=[{"role": "wizard", "content": "hi"}]), "messages[0].role"),
        (_chat(messages="hi"), "messages"),
        (_chat(response_format="json"), "response_format"),
        (_chat(response_format={"type": "json_schema", "json_schema": "x"}), "response_format.json_schema"),
        (
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "properties": {"a": 5}}},
                }
            ),
            "response_format.json_schema.schema.properties.a",
        ),
        (
            _chat(
                response_format={
                    "type": "json_schema",
                    "json_schema": {"schema": {"type": "object", "properties": {"a": True}}},
                }
            ),
            "response_format.json_schema.schema.properties.a",
        ),
        (_chat(seed=1e400), "seed"),
        (_chat(seed=1.5), "seed"),
        (_chat(seed=True), "seed"),
        (_chat(max_tokens=0), "max_tokens"),
        (_chat(max_tokens=-3), "max_tokens"),
        (_chat(max_completion_tokens="many"), "max_completion_tokens"),
        (_chat(temperature=-0.5), "temperature"),  # 0 is greedy, as OpenAI
        (_chat(temperature="hot"), "temperature"),
        (_chat(top_p=1.5), "top_p"),
        (_chat(top_k=2.5), "top_k"),
        (_chat(stream="yes"), "stream"),
        (_chat(stream_options={"include_usage": True}), "stream_options"),
        (_chat(stream=True, stream_options={"include_usage": "yes"}), "stream_options"),
        (_chat(n=0), "n"),
        (_chat(n=50), "n"),
        (_chat(stop=["a", "b", "c", "d", "e"]), "stop"),
        (_chat(stop=[""]), "stop"),
        (_chat(logprobs="yes"), "logprobs"),
        (_chat(top_logprobs=3), "top_logprobs"),
        (_chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ],
)
def test_malformed_requests_get_400_naming_the_field(
    server: tuple[httpx.Client, StandInEngine], body: Any, param: str | None
) -> None:
    client, engine = server
    raw = json.dumps(body).replace("Infinity", "1e400")  # 1e400 as the literal a client sends
    reply = client.post(
        "/v1/chat/completions", content=raw.encode(), headers={"Content-Type": "application/json"}
    )
    _refused(reply, 400, param)
    assert engine.calls == []


def test_non_json_constants_are_refused(server: tuple[httpx.Client, StandInEngine]) -> None:
    client, _ = server
    reply = client.post("/v1/chat/completions", content=b'{"model": "x", "temperature": NaN}')
    _refused(reply, 400, None, "not valid JSON")


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


# the real engine: the review's requests against the tiny published model


@pytest.fixture(scope="module")
def tiny_model(tiny_run: Path) -> LocalModel:
    return LocalModel.open(tiny_run / "releases", "v1", tiny_run / "keys" / "trusted")


@pytest.mark.slow
def test_the_real_engine_is_bounded_by_its_context(tiny_model: LocalModel) -> None:
    context = tiny_model.context_tokens
    long_schema = {
        "type": "object",
        "properties": {"line": {"type": "string", "minLength": 3900}},
        "required": ["line"],
    }
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": long_schema}}
    with serve_app(create_app(tiny_model)) as url:
        post = lambda body: httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)  # noqa: E731
        free = post(_chat(max_tokens=4000))
        assert free.status_code == 200 and free.json()["usage"]["total_tokens"] <= context, free.text
        # minLength 3900 with max_tokens 4000: never more than the context (the engine may also
        # refuse a schema that cannot close within the clamped budget)
        forced = post(_chat(max_tokens=4000, response_format=fmt))
        if forced.status_code == 200:
            assert forced.json()["usage"]["total_tokens"] <= context
        else:
            _refused(forced, 400, "response_format", "cannot be compiled")
        huge = _chat(messages=[{"role": "user", "content": "the light " * 3000}])
        _refused(post(huge), 400, "messages", f"{context} tokens")
        for body in ([1, 2], _chat(seed=1e400), _chat(max_tokens=0), _chat(response_format="json")):
            raw = json.dumps(body).replace("Infinity", "1e400")
            assert (
                httpx.post(f"{url}/v1/chat/completions", content=raw.encode(), timeout=60).status_code == 400
            )


@pytest.mark.slow
def test_the_real_engine_answers_400_to_both(tiny_model: LocalModel) -> None:
    with serve_app(create_app(tiny_model)) as url:
        reply = httpx.post(f"{url}/v1/chat/completions", content=SURROGATE % tiny_model.label.encode())
        _assert_400(reply, "surrogate")
        body = _chat(tiny_model.label, response_format=_fmt(BIG_SCHEMAS[0]))
        _assert_400(httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60), "cannot be compiled")
        ok = httpx.post(f"{url}/v1/chat/completions", json=_chat(tiny_model.label, max_tokens=4), timeout=60)
        assert ok.status_code == 200 and json.loads(ok.text)["usage"]["completion_tokens"] <= 4
