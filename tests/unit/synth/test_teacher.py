"""Teacher backends against a loopback server: retries, backoff, Retry-After, timeouts,
fast failures, the durable cache; Anthropic's API shape; replay; hf_local on the tiny base."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nimmer_train.config import TeacherConfig
from nimmer_train.synth.teacher import (
    ResponseCache,
    TeacherFatalError,
    TeacherUnavailable,
    make_teacher,
    run_requests,
)
from nimmer_train.voice.composition import expand
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.compose import composition
from tests.helpers.llm_server import serve


@pytest.fixture(scope="module")
def requests():
    spec = composition("composition.registers=[hivemind-broadcast]", "composition.per_register=6")
    return expand(spec, load_catalogue())


def _cfg(url: str, tmp_path: Path, **kw) -> TeacherConfig:
    base = dict(
        backend="openai_compatible",
        model="test-model",
        base_url=f"{url}/v1",
        max_retries=3,
        backoff_base_s=0.01,
        backoff_max_s=0.05,
        timeout_s=5.0,
        concurrency=4,
        cache=str(tmp_path / "cache.sqlite"),
    )
    return TeacherConfig(**{**base, **kw})


def test_openai_request_shape_and_cache(requests, tmp_path: Path) -> None:
    with serve() as server:
        cfg = _cfg(server.url, tmp_path)
        cache = ResponseCache(Path(cfg.cache))
        results = list(run_requests(requests, make_teacher(cfg), cache))
        assert len(results) == 6 and not any(cached for _, _, cached in results)
        body = server.requests[0]
        assert body["model"] == "test-model" and body["response_format"] == {"type": "json_object"}
        assert {"temperature", "top_p", "top_k", "repetition_penalty", "min_p"} <= set(body)
        assert body["temperature"] == 0.2  # hivemind-broadcast's baseline from the scene table
        assert results[0][1].prompt_tokens == 40 and results[0][1].completion_tokens == 12
        again = list(run_requests(requests, make_teacher(cfg), ResponseCache(Path(cfg.cache))))
        assert server.total == 6 and all(cached for _, _, cached in again)  # paid once


def test_429_retry_after_is_honoured(requests, tmp_path: Path) -> None:
    with serve() as server:
        server.script = [(429, {"Retry-After": "1"}, "slow down")]
        start = time.perf_counter()
        reply = make_teacher(_cfg(server.url, tmp_path, concurrency=1)).generate(requests[:1])[0]
        assert reply.error is None and time.perf_counter() - start >= 1.0
        assert server.total == 2


def test_5xx_backoff_then_success_and_exhaustion(requests, tmp_path: Path) -> None:
    with serve() as server:
        server.script = [(500, {}, "boom"), (503, {}, "busy")]
        assert make_teacher(_cfg(server.url, tmp_path)).generate(requests[:1])[0].error is None
        assert server.total == 3
        server.script = [(502, {}, "bad gateway")] * 4
        reply = make_teacher(_cfg(server.url, tmp_path)).generate(requests[1:2])[0]
        assert reply.error == "http_502" and reply.content is None  # recorded, not raised


def test_timeout_and_malformed_body_become_errors(requests, tmp_path: Path) -> None:
    with serve() as server:
        server.script = ["slow", "slow"]
        reply = make_teacher(_cfg(server.url, tmp_path, timeout_s=0.3, max_retries=1)).generate(requests[:1])[
            0
        ]
        assert reply.error == "timeout"
        server.script = ["malformed", "malformed"]
        reply = make_teacher(_cfg(server.url, tmp_path, max_retries=1)).generate(requests[:1])[0]
        assert reply.error == "malformed_response"
        server.script = ["malformed"]
        assert make_teacher(_cfg(server.url, tmp_path)).generate(requests[:1])[0].error is None


def test_failures_are_not_cached(requests, tmp_path: Path) -> None:
    with serve() as server:
        server.script = [(500, {}, "x")] * 2
        cfg = _cfg(server.url, tmp_path, max_retries=1, concurrency=1)
        first = list(run_requests(requests[:1], make_teacher(cfg), ResponseCache(Path(cfg.cache))))
        assert first[0][1].error == "http_500"
        second = list(run_requests(requests[:1], make_teacher(cfg), ResponseCache(Path(cfg.cache))))
        assert second[0][1].error is None and not second[0][2]  # asked again, now answered


def test_an_unreachable_teacher_stops_the_run_and_keeps_what_arrived(requests, tmp_path: Path) -> None:
    with serve() as server:  # answers two requests, then the backend is down (500 to everything)
        cfg = _cfg(server.url, tmp_path, max_retries=0, concurrency=1, max_failure_share=0.2)
        server.script = ["ok", "ok"] + [(500, {}, "down")] * 10
        with pytest.raises(
            TeacherUnavailable, match=r"2 requests got no reply \(http_500 2\).*2 new replies"
        ):
            list(run_requests(requests, make_teacher(cfg), ResponseCache(Path(cfg.cache)), 0.2))
        assert server.total == 4  # stopped at the second failure: 6 requests allow int(0.2 * 6) = 1
    retry = list(run_requests(requests[:2], make_teacher(cfg), ResponseCache(Path(cfg.cache))))
    assert all(cached for _, _, cached in retry)  # what arrived before the failure is kept


def test_nothing_listening_fails_fast_naming_the_address(requests, tmp_path: Path) -> None:
    cfg = _cfg("http://127.0.0.1:9", tmp_path, max_retries=0)
    with pytest.raises(TeacherUnavailable, match=r"127\.0\.0\.1:9.*connection"):
        list(run_requests(requests, make_teacher(cfg), ResponseCache(Path(cfg.cache)), cfg.max_failure_share))


def test_retries_are_logged_with_reason_and_wait(requests, tmp_path: Path, caplog) -> None:
    with serve() as server, caplog.at_level("WARNING", logger="nimmer_train.synth.teacher.http"):
        server.script = [(503, {}, "busy"), (429, {"Retry-After": "0"}, "slow down")]
        assert make_teacher(_cfg(server.url, tmp_path)).generate(requests[:1])[0].error is None
    lines = [r.getMessage() for r in caplog.records]
    assert any("http_503 (attempt 1 of 4); retrying in" in line for line in lines)
    assert any("http_429 (attempt 2 of 4); retrying in 0.0 s as the server asked" in line for line in lines)


@pytest.mark.parametrize("status", [400, 401, 403])
def test_client_errors_fail_fast_with_a_clear_message(requests, tmp_path: Path, status: int) -> None:
    with serve() as server:
        server.script = [(status, {}, '{"error": "nope"}')]
        with pytest.raises(TeacherFatalError, match=f"answered {status}"):
            make_teacher(_cfg(server.url, tmp_path)).generate(requests[:1])
        assert server.total == 1  # no retries


def test_api_key_comes_from_the_named_variable(requests, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NIMMER_TEST_KEY", "sk-test-123")
    with serve() as server:
        make_teacher(_cfg(server.url, tmp_path, api_key_env="NIMMER_TEST_KEY")).generate(requests[:1])
        assert server.headers[0]["Authorization"] == "Bearer sk-test-123"
    monkeypatch.delenv("NIMMER_TEST_KEY")
    with pytest.raises(TeacherFatalError, match="NIMMER_TEST_KEY"):
        make_teacher(_cfg("http://127.0.0.1:9", tmp_path, backend="anthropic", api_key_env="NIMMER_TEST_KEY"))


def test_anthropic_messages_api_shape(requests, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("NIMMER_TEST_KEY", "ak-1")
    with serve() as server:
        cfg = _cfg(
            server.url, tmp_path, backend="anthropic", base_url=server.url, api_key_env="NIMMER_TEST_KEY"
        )
        reply = make_teacher(cfg).generate(requests[:1])[0]
        body, headers = server.requests[0], server.headers[0]
        assert headers["x-api-key"] == "ak-1" and headers["anthropic-version"]
        assert body["system"].startswith("You are speaking as") and body["messages"][0]["role"] == "user"
        assert "top_p" not in body and body["max_tokens"] == 200
        assert reply.content and reply.prompt_tokens == 40 and "min_p" in reply.dropped_knobs


def test_replay_answers_by_request_hash(requests, tmp_path: Path) -> None:
    replay = tmp_path / "replay.jsonl"
    replay.write_text(
        json.dumps({"key": requests[0].key, "response": {"content": '{"utterance": "x"}'}}) + "\n"
    )
    teacher = make_teacher(TeacherConfig(backend="replay", replay_file=str(replay)))
    first, second = teacher.generate(requests[:2])
    assert first.content == '{"utterance": "x"}' and second.error == "no_replay_answer"


@pytest.mark.slow
def test_hf_local_generates_with_the_tiny_base(requests, tiny_run: Path, tmp_path: Path) -> None:
    (base,) = [p for p in (tiny_run / "artifacts/base").iterdir() if not p.name.startswith(".")]
    spec = composition(
        "composition.registers=[hivemind-broadcast,drunk-scavenger]", "composition.per_register=2"
    )
    batch = expand(spec, load_catalogue())  # two registers: two different sampling knobs
    cfg = TeacherConfig(backend="hf_local", model_path=str(base), max_new_tokens=12, batch_size=4)
    replies = make_teacher(cfg).generate(batch)
    assert len(replies) == 4
    assert all(r.error is None and r.completion_tokens > 0 and r.prompt_tokens > 100 for r in replies)
    assert [r.content for r in make_teacher(cfg).generate(batch)] == [r.content for r in replies]
