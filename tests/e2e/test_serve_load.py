"""``nimmer serve`` under load (issue 18, reliability): rounds of mixed requests at concurrency 16
against a real server on loopback over a tiny published version with three register LoRAs:
registers and schemas mixed, streaming and not, clients that hang up mid-stream, malformed
bodies, oversized prompts, unknown models and bad parameters. Every well-formed request gets a
correct response, every bad one a 4xx naming the problem, nothing crashes, the queue empties
after each round, and the process's memory does not grow from round to round."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import validate

from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.openai_server import create_app
from tests.helpers.loopback import serve_app
from tests.helpers.published import publish_registers

pytestmark = pytest.mark.slow

ROUNDS, PER_ROUND, CONCURRENCY = 4, 75, 16
SCHEMA = {
    "type": "object",
    "properties": {"line": {"type": "string", "maxLength": 40}},
    "required": ["line"],
    "additionalProperties": False,
}
MESSAGES = [
    {"role": "system", "content": '{"role":"a caste-preacher"}'},
    {"role": "user", "content": "Speak."},
]


def _rss_mib() -> float:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * 4096 / 2**20


def _plan(label: str, registers: list[str], rng: random.Random) -> list[tuple[str, dict[str, Any] | bytes]]:
    """(kind, body) for one round: mostly good requests, a bad one of each kind now and then."""
    models = [label, *(f"{label}:{r}" for r in registers)]
    plan: list[tuple[str, dict[str, Any] | bytes]] = []
    for i in range(PER_ROUND):
        body: dict[str, Any] = {
            "model": models[i % len(models)],
            "messages": MESSAGES,
            "max_tokens": rng.choice([8, 16, 32]),
            "temperature": rng.choice([0.7, 1.0, 1.2]),
            "top_k": rng.choice([0, 40]),
            "seed": i,
        }
        if i % 2:
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "l", "schema": SCHEMA}}
            body["max_tokens"] = 48
        kind = ["plain", "stream", "plain", "stream", "hangup", "bad"][i % 6]
        if kind == "stream":
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        if kind == "hangup":
            body |= {"stream": True, "max_tokens": 200}
            body.pop("response_format", None)
        if kind == "bad":
            kind, bad = rng.choice(
                [
                    ("malformed", b'{"model": "x", "messages": [}'),
                    ("oversized", {**body, "messages": [{"role": "user", "content": "the gate " * 3000}]}),
                    ("unknown_model", {**body, "model": f"{label}:no-such-register"}),
                    ("bad_param", {**body, "temperature": "hot"}),
                    ("bad_n", {**body, "n": 50}),
                ]
            )
            plan.append((kind, bad))
            continue
        plan.append((kind, body))
    return plan


EXPECTED = {  # bad request -> (status, what the message must name)
    "malformed": (400, "not valid JSON"),
    "oversized": (400, "context"),
    "unknown_model": (404, "no-such-register"),
    "bad_param": (400, "temperature"),
    "bad_n": (400, "n:"),
}


async def _one(client: httpx.AsyncClient, kind: str, body: Any) -> str:
    """Send one request and check its answer; returns the outcome's name."""
    if isinstance(body, bytes):
        reply = await client.post("/v1/chat/completions", content=body)
    elif kind in ("stream", "hangup"):
        async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200, await reply.aread()
            events: list[Any] = []
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if kind == "hangup" and len(events) >= 2:
                    return "hung_up"  # leaving the block closes the connection mid-stream
                events.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
        assert events[-1] == "[DONE]" and "error" not in events[-2]
        chunks = events[:-1]
        text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
        usage = chunks[-1]["usage"]
        assert chunks[-1]["choices"] == [] and usage["completion_tokens"] <= body["max_tokens"]
        finish = [
            c["choices"][0]["finish_reason"]
            for c in chunks
            if c["choices"] and c["choices"][0]["finish_reason"]
        ]
        _check_text(body, text, finish[0])
        return "stream_ok"
    else:
        reply = await client.post("/v1/chat/completions", json=body)
    if kind in EXPECTED:
        status, word = EXPECTED[kind]
        assert reply.status_code == status, (kind, reply.text)
        assert word in reply.json()["error"]["message"], (kind, reply.text)
        return kind
    assert reply.status_code == 200, reply.text
    data = reply.json()
    usage = data["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    _check_text(body, data["choices"][0]["message"]["content"], data["choices"][0]["finish_reason"])
    return "plain_ok"


def _check_text(body: dict[str, Any], text: str, finish: str) -> None:
    if "response_format" in body and finish == "stop":  # closed within its budget: valid under the schema
        validate(json.loads(text), SCHEMA)


async def _round(url: str, plan: list[tuple[str, Any]]) -> Counter[str]:
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def guarded(kind: str, body: Any) -> str:
            async with gate:
                return await _one(client, kind, body)

        return Counter(await asyncio.gather(*(guarded(k, b) for k, b in plan)))


def test_serve_under_mixed_load(tmp_path: Path) -> None:
    releases, trusted = publish_registers(tmp_path)
    model = LocalModel.open(releases, "v1", trusted)
    rng = random.Random(18)
    counts: Counter[str] = Counter()
    memory: list[float] = []
    started = time.perf_counter()
    try:
        with serve_app(create_app(model)) as url:
            for _ in range(ROUNDS):
                counts += asyncio.run(_round(url, _plan(model.label, model.registers, rng)))
                deadline = time.monotonic() + 600  # hung-up rows leave at the next step
                while (model.engine.rows or model.engine.waiting) and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert not model.engine.rows and not model.engine.waiting and model.engine.cache is None
                assert httpx.get(f"{url}/health").status_code == 200
                memory.append(_rss_mib())
            metrics = httpx.get(f"{url}/metrics").text
    finally:
        model.close()
    print(f"load test: {dict(counts)} in {time.perf_counter() - started:.1f} s; RSS MiB by round {memory}")
    assert sum(counts.values()) == ROUNDS * PER_ROUND
    assert counts["plain_ok"] and counts["stream_ok"] and counts["hung_up"]
    assert sum(counts[k] for k in EXPECTED) == ROUNDS * len(range(5, PER_ROUND, 6))  # every bad one refused
    assert "nimmer_serve_requests_running 0" in metrics and "nimmer_serve_requests_waiting 0" in metrics
    assert memory[-1] - memory[1] < 32, memory  # after the first round's warm-up, no growth
