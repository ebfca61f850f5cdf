"""synthesize end to end: a real teacher over HTTP (loopback stand-in), kill and resume without
paying twice (counted on the server), bad replies recorded while the run goes on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from datasets import load_from_disk

from nimmer_train.voice.composition import expand
from nimmer_train.voice.registers import load_catalogue
from tests.helpers import REPO
from tests.helpers.compose import composition
from tests.helpers.llm_server import serve
from tests.helpers.outputs import synth_dir as _synth_dir
from tests.helpers.pipelines import kill_when, run_pipeline

pytestmark = pytest.mark.slow


TWO = "composition.registers=[caste-preacher,drunk-scavenger]"


def seed_answers() -> dict[str, str]:
    """The seed set's reply for each teacher system prompt, so the stand-in answers in voice."""
    replay = REPO / "data/seed/teacher_replay_v1.jsonl"
    by_key = {}
    for line in replay.read_text().splitlines():
        row = json.loads(line)
        by_key[row["key"]] = row["response"]["content"]
    return {r.messages[0]["content"]: by_key[r.key] for r in expand(composition(), load_catalogue())}


def _teacher(url: str, concurrency: int = 2) -> list[str]:
    return [
        "teacher=openai_compatible",
        f"teacher.base_url={url}/v1",
        "teacher.model=seed-echo",
        f"teacher.concurrency={concurrency}",
        "teacher.backoff_base_s=0.01",
        "teacher.max_retries=1",
        "teacher.price_in_per_mtok=1.0",
        "teacher.price_out_per_mtok=2.0",
    ]


def test_killed_run_resumes_without_asking_twice(tmp_path: Path) -> None:
    answers = seed_answers()
    n = len(expand(composition(TWO), load_catalogue()))  # two registers of the demo composition
    assert n == 192
    with serve(lambda body: answers[body["messages"][0]["content"]], latency_s=0.05) as server:
        kill_when("synthesize", tmp_path, TWO, *_teacher(server.url), ready=lambda: server.total >= 40)
        asked_before = server.total
        assert not (tmp_path / "artifacts/synth").exists() or not any(
            p for p in (tmp_path / "artifacts/synth").iterdir() if not p.name.startswith(".")
        )

        run_pipeline("synthesize", tmp_path, TWO, *_teacher(server.url))
        assert len(server.counts) == n  # every request answered once at least
        twice = [k for k, n in server.counts.items() if n > 1]
        assert len(twice) <= 2  # at most the requests in flight when the job was killed
        assert server.total - asked_before == n - (asked_before - len(twice))

    stats = json.loads((_synth_dir(tmp_path) / "stats.json").read_text())
    assert stats["r0"] == n and stats["cached"] >= asked_before - 2
    assert stats["requested"] == n - stats["cached"]
    assert stats["tokens"] == {"prompt": n * 40, "completion": n * 12}
    assert stats["cost_usd"]["corpus_total"] == pytest.approx((n * 40 * 1.0 + n * 12 * 2.0) / 1e6)


def test_bad_replies_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    answers = seed_answers()
    prompts = sorted(answers)
    broken = {prompts[0]: "", prompts[1]: "I refuse to answer in JSON.", prompts[2]: '{"line": "wrong key"}'}

    def answer(body: dict) -> str:
        system = body["messages"][0]["content"]
        return broken.get(system, answers[system])

    with serve(answer) as server:
        server.script = ["slow"] * 2  # one request never arrives in time (timeout, retried once)
        run_pipeline(
            "synthesize",
            tmp_path,
            "composition.per_register=12",
            *_teacher(server.url, concurrency=1),
            "teacher.timeout_s=0.5",
        )
    folder = _synth_dir(tmp_path)
    stats = json.loads((folder / "stats.json").read_text())
    assert stats["r0"] == 60 and stats["rejections"].get("timeout") == 1
    r0 = load_from_disk(str(folder / "r0"))
    assert len(r0) == 60 and {r["reason"] for r in r0 if r["status"] == "rejected"} >= {"timeout"}
    r1 = load_from_disk(str(folder / "r1"))
    row = r1["train"][0]
    assert [m["role"] for m in row["messages"]] == ["system", "user", "assistant"]
    assert json.loads(row["messages"][2]["content"])["utterance"]
    assert json.loads(row["messages"][0]["content"])["turn_intent"] == row["turn_intent"]


def test_an_unreachable_teacher_fails_the_run_and_the_next_run_continues(tmp_path: Path) -> None:
    answers = seed_answers()
    one = ("composition.registers=[caste-preacher]", "composition.per_register=12")
    down = run_pipeline(
        "synthesize", tmp_path, *one, *_teacher("http://127.0.0.1:9", concurrency=1), check=False
    )
    assert down.returncode == 1, down.stderr
    assert (
        "error: teacher openai_compatible (http://127.0.0.1:9/v1/chat/completions) is failing" in down.stderr
    )
    assert "connection" in down.stderr and "re-run" in down.stderr
    published = tmp_path / "artifacts/synth"
    assert not published.exists() or not [p for p in published.iterdir() if not p.name.startswith(".")]

    with serve(lambda body: answers[body["messages"][0]["content"]]) as server:
        run_pipeline("synthesize", tmp_path, *one, *_teacher(server.url, concurrency=1))
        assert server.total == 12  # nothing had arrived: everything asked once, now answered
    stats = json.loads((_synth_dir(tmp_path) / "stats.json").read_text())
    assert stats["r0"] == 12 and "backend_error" not in stats["rejections"]
