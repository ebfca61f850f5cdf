"""``nimmer serve`` over the batching engine (issue 18, items 2-3), on loopback with the tiny
published version of conftest.py: streaming through the official ``openai`` client, usage, n,
stop, logprobs, /health, /metrics, 429 with Retry-After, a disconnect freeing its row, an error
mid-stream, graceful shutdown, and adapters (un)loaded only through the signed registry."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import uvicorn
from jsonschema import validate

from nimmer_train.runtime.local_model import EngineSettings, LocalModel
from nimmer_train.runtime.openai_server import create_app

SCHEMA = {
    "type": "object",
    "properties": {"line": {"type": "string"}, "mood": {"type": "string", "enum": ["calm", "wry"]}},
    "required": ["line", "mood"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "line", "schema": SCHEMA}}
MESSAGES = [
    {"role": "system", "content": '{"role":"a drunk scavenger"}'},
    {"role": "user", "content": "Speak."},
]


def test_openai_client_streams_a_schema_completion_as_valid_json(model: LocalModel, url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    mid = f"{model.label}:drunk-scavenger"
    args: dict[str, Any] = {
        "model": mid,
        "messages": MESSAGES,
        "max_tokens": 40,
        "seed": 11,
        "response_format": FORMAT,
    }
    stream = client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    validate(json.loads(text), SCHEMA)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finish == ["stop"] and chunks[-1].choices == [] and chunks[-1].usage is not None
    assert len({c.id for c in chunks}) == 1
    whole = client.chat.completions.create(**args)  # the same seed without streaming: the same text
    assert whole.choices[0].message.content == text
    assert whole.usage is not None and whole.usage.model_dump() == {
        **chunks[-1].usage.model_dump(),
    }
    assert whole.usage.prompt_tokens == len(model.prompt_ids(MESSAGES))


def test_n_logprobs_and_stop(model: LocalModel, url: str) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    reply = client.chat.completions.create(
        model=model.label, messages=MESSAGES, max_tokens=12, n=3, seed=5, logprobs=True, top_logprobs=3
    )
    assert [c.index for c in reply.choices] == [0, 1, 2]
    assert len({c.message.content for c in reply.choices}) > 1
    assert reply.usage.completion_tokens == sum(len(c.logprobs.content) for c in reply.choices)
    assert all(len(t.top_logprobs) == 3 for c in reply.choices for t in c.logprobs.content)
    text = reply.choices[0].message.content
    stop = next(w for w in text.split() if len(w) >= 2 and text.find(w) > 0)
    cut = client.chat.completions.create(
        model=model.label, messages=MESSAGES, max_tokens=12, seed=5, stop=[stop]
    )
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_health_and_metrics(model: LocalModel, url: str) -> None:
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    httpx.post(
        f"{url}/v1/chat/completions",
        json={"model": f"{model.label}:hivemind-broadcast", "messages": MESSAGES, "max_tokens": 5},
        timeout=600,
    ).raise_for_status()
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "nimmer_serve_requests_running 0",
        "nimmer_serve_requests_waiting 0",
        "nimmer_serve_batch_size_bucket",
        'nimmer_serve_time_to_first_token_seconds_count{register="hivemind-broadcast"}',
        'nimmer_serve_e2e_latency_seconds_bucket{register="hivemind-broadcast",le="+Inf"}',
        'nimmer_serve_completion_tokens_total{register="hivemind-broadcast"}',
        'nimmer_serve_prompt_tokens_total{register="hivemind-broadcast"}',
    ):
        assert name in text, name


def test_a_disconnect_frees_the_row_and_errors_arrive_in_stream(
    model: LocalModel, url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"model": model.label, "messages": MESSAGES, "max_tokens": 400, "stream": True}

    def ended() -> dict[str, int]:
        out: dict[str, int] = {}
        for (_, finish), n in model.engine.metrics.rows.items():
            out[finish] = out.get(finish, 0) + n
        return out

    before = ended()
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        while not model.engine.rows:
            time.sleep(0.01)
    deadline = time.monotonic() + 600
    while model.engine.rows and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not model.engine.rows  # the row left the batch
    after = ended()
    # one row ended: cancelled by the hang-up (or, on a loaded machine, by its end token first)
    assert sum(after.values()) == sum(before.values()) + 1

    def broken(*args: Any) -> Any:
        raise RuntimeError("forced for the test")

    monkeypatch.setattr(model.engine, "_forward", broken)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
    with pytest.raises(openai.APIError, match="forced for the test"):
        list(client.chat.completions.create(model=model.label, messages=MESSAGES, max_tokens=5, stream=True))
    reply = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": False}, timeout=600)
    assert reply.status_code == 500 and "forced for the test" in reply.json()["error"]["message"]
    monkeypatch.undo()
    assert model.engine.alive


def test_adapters_load_only_through_the_signed_registry(model: LocalModel, url: str) -> None:
    post = lambda path, body: httpx.post(f"{url}/v1/{path}", json=body, timeout=600)  # noqa: E731
    ids = lambda: [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]  # noqa: E731
    gone = f"{model.label}:hivemind-broadcast"
    assert post("unload_lora_adapter", {"lora_name": "hivemind-broadcast"}).status_code == 200
    assert gone not in ids()
    chat = {"model": gone, "messages": MESSAGES, "max_tokens": 4}
    assert post("chat/completions", chat).status_code == 404
    assert post("load_lora_adapter", {"lora_name": gone}).status_code == 200
    assert gone in ids() and post("chat/completions", chat).status_code == 200
    assert (
        post("load_lora_adapter", {"lora_name": "caste-preacher", "lora_path": "/tmp/x"}).status_code == 400
    )
    refused = post("load_lora_adapter", {"lora_name": "imperial-ceremony-chorus"})
    assert refused.status_code == 404 and "registry" in refused.json()["error"]["message"]


@contextmanager
def _server(app: Any) -> Iterator[tuple[str, uvicorn.Server]]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # a hang guard
    while not server.started:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", server
    finally:
        server.should_exit = True
        thread.join(timeout=600)


def test_loading_503_then_a_bounded_queue_then_graceful_shutdown(published: tuple[Path, Path]) -> None:
    releases, trusted = published
    gate, loaded = threading.Event(), []

    def load() -> LocalModel:
        gate.wait(600)
        loaded.append(
            LocalModel.open(releases, "v1", trusted, settings=EngineSettings(max_batch=2, max_waiting=1))
        )
        return loaded[0]

    with _server(create_app(load)) as (url, server):
        assert httpx.get(f"{url}/health").status_code == 503
        assert httpx.get(f"{url}/v1/models").status_code == 503
        gate.set()
        deadline = time.monotonic() + 600
        while httpx.get(f"{url}/health").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        label = loaded[0].label
        body = {"model": label, "messages": MESSAGES, "max_tokens": 120}
        replies: list[httpx.Response] = []
        lock = threading.Lock()

        def post() -> None:
            reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
            with lock:
                replies.append(reply)

        threads = [threading.Thread(target=post) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy = [r for r in replies if r.status_code == 429]
        assert busy and all(int(r.headers["Retry-After"]) >= 1 for r in busy)
        assert "busy" in busy[0].json()["error"]["message"]
        assert all(r.status_code in (200, 429) for r in replies)
        # graceful shutdown: the two running turns finish in full after the server is told to exit
        replies.clear()
        engine = loaded[0].engine
        started = lambda: sum(h.n for h in engine.metrics.ttft_by.values())  # noqa: E731
        before = started()
        threads = [threading.Thread(target=post) for _ in range(2)]
        for t in threads:
            t.start()
        # both accepted (prefilled or queued) before the exit: a request still in flight to the
        # socket would be refused by a closing server, which is no dropped turn
        while started() + len(engine.waiting) - before < 2:
            time.sleep(0.005)
        server.should_exit = True
        for t in threads:
            t.join()
    assert [r.status_code for r in replies] == [200, 200]
    assert all(r.json()["choices"][0]["finish_reason"] in ("stop", "length") for r in replies)
    assert not loaded[0].engine.alive  # the app loaded it, the app closed it
