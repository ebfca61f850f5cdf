"""The batching engine (issue 18, item 1) on a tiny published version with three register LoRAs
of random non-zero weights: per-row knobs equal the single-row processors, the stacked LoRA
equals PEFT's own mixed-adapter batch, a seeded request says the same alone and inside a mixed
batch, requests join a running batch between steps, and a cancelled row leaves at once."""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from jsonschema import validate

from nimmer_train import cli
from nimmer_train.errors import NimmerError
from nimmer_train.runtime import stacked_lora
from nimmer_train.runtime.engine import Delta, Done, Event, Failed, Job, _safe_end
from nimmer_train.runtime.local_model import EngineSettings, LocalModel, native_bf16, serving_dtype
from nimmer_train.runtime.rings import RingA
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, AffectState, MemoryScope, TurnPrompt
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import SamplingKnobs, knob_processors, warp_rows

MESSAGES = [
    {"role": "system", "content": '{"role":"a caste-preacher"}'},
    {"role": "user", "content": "Speak of the gate."},
]
SCHEMA = {"type": "object", "properties": {"line": {"type": "string"}}, "required": ["line"]}
KNOBS = [
    SamplingKnobs(0.9, 0.95, 40, 1.1, 0.02, max_new_tokens=24),
    SamplingKnobs(1.3, 1.0, 0, 1.0, 0.0, max_new_tokens=16),
    SamplingKnobs(0.4, 0.6, 5, 1.5, 0.1, max_new_tokens=20),
    SamplingKnobs(1.0, 0.8, 0, 1.2, 0.05, max_new_tokens=14),  # (13: the schema's smallest reply)
]


# every row with a top_k: warp_rows then works on each row's top-k candidates only
TOP_K_KNOBS = [dataclasses.replace(k, top_k=k.top_k or 60) for k in KNOBS]


# the no-repeat n-gram guard on some rows (n = 2, 3, off, 1), over replies that repeat themselves
NGRAM_KNOBS = [
    dataclasses.replace(k, no_repeat_ngram_size=n) for k, n in zip(KNOBS, (2, 3, 0, 1), strict=True)
]
REPLIES = [[5, 6, 6, 299], [], [1, 2, 3, 4, 5, 6, 7, 8], [250]]
LOOPING = [[5, 6, 7, 5, 6, 9, 6], [7, 8, 9, 7, 8], [1, 2, 1, 2, 1], [250, 3, 250]]


@pytest.mark.parametrize(
    ("knobs_of_rows", "generated"),
    [(KNOBS, REPLIES), (TOP_K_KNOBS, REPLIES), (NGRAM_KNOBS, LOOPING)],
    ids=["some-top-k", "all-top-k", "no-repeat-ngram"],
)
def test_per_row_knobs_equal_the_single_row_processors(
    knobs_of_rows: list[SamplingKnobs], generated: list[list[int]]
) -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(len(KNOBS), 300, generator=gen) * 3
    batched = warp_rows(scores.clone(), knobs_of_rows, generated)
    for i, (knobs, ids) in enumerate(zip(knobs_of_rows, generated, strict=True)):
        prompt = [9, 10, 11]  # never penalised
        one = knob_processors(knobs, len(prompt))(torch.tensor([prompt + ids]), scores[i : i + 1].clone())
        assert torch.equal(torch.isinf(batched[i]), torch.isinf(one[0])), i
        finite = ~torch.isinf(one[0])
        assert torch.allclose(batched[i][finite], one[0][finite]), i


def test_safe_end_holds_back_partial_characters_and_stop_prefixes() -> None:
    assert _safe_end("Hello wor", ("world",)) == 6  # "wor" may begin the stop string
    assert _safe_end("Hello\ufffd", ()) == 5
    assert _safe_end("Hello", ("xyz",)) == 5


@pytest.fixture(scope="module")
def model(published: tuple[Path, Path]) -> LocalModel:
    releases, trusted = published
    m = LocalModel.open(releases, "v1", trusted, settings=EngineSettings(window_s=0.05))
    yield m
    m.close()


@pytest.mark.parametrize(
    "dense_max", [stacked_lora.DENSE_MAX, 0], ids=["every-adapter-masked", "per-row-gather"]
)
def test_stacked_lora_equals_peft_mixed_batches(
    published: tuple[Path, Path], dense_max: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import load_verified, open_version
    from nimmer_train.runtime.stacked_lora import StackedLora

    monkeypatch.setattr(stacked_lora, "DENSE_MAX", dense_max)
    releases, trusted = published
    peft, _ = load_verified(open_version(releases, "v1", Keyring.load(trusted)))
    names = ["__base__", "caste-preacher", "drunk-scavenger", "hivemind-broadcast", "caste-preacher"]
    ids = torch.randint(3, 400, (len(names), 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = peft(input_ids=ids, adapter_names=names).logits
        bare = peft.get_base_model()(input_ids=ids).logits  # LoRA layers still active: caste-preacher
        stacked = StackedLora(peft)
        stacked.select([None if n == "__base__" else n for n in names])
        mine = peft.get_base_model()(input_ids=ids).logits
    assert torch.allclose(mine, reference, atol=1e-4)
    assert not torch.allclose(reference[0], reference[2], atol=1e-3)  # the registers differ
    assert not torch.allclose(bare[0], reference[0], atol=1e-3)
    assert all((layer.dense is not None) == bool(dense_max) for layer in stacked.layers)
    # a ragged step's flattened tokens: one per row (3 rows), then two joining prompts' (5 and 4)
    layer = stacked.layers[0]
    rows, joining = ["caste-preacher", None, "drunk-scavenger"], [("drunk-scavenger", 5), (None, 4)]
    per_token = [*rows, *(a for a, n in joining for _ in range(n))]
    x = torch.randn(1, len(per_token), layer.in_features, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        stacked.select(rows, joining)
        got = layer(x)[0]
        names = ["__base__" if a is None else a for a in per_token]
        want = type(layer).forward(layer, x[0][:, None], adapter_names=names)[:, 0]  # PEFT's own
        # a LoRA on the output layer sees only the kept positions: each row's, each prompt's last
        kept = [0, 1, 2, 3 + 5 - 1, 3 + 5 + 4 - 1]
        got_kept = layer(x[:, kept])[0]
        stacked.select(rows)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_kept, want[kept], rtol=1e-4, atol=1e-5)
    assert not torch.allclose(want[3], layer.base_layer(x[0][3]), atol=1e-3)  # a LoRA token


def _collect(model: LocalModel, jobs: list[Job], events: list[queue.Queue]) -> list[list[Event]]:
    for job in jobs:
        model.engine.submit(job)
    out = []
    for job, q in zip(jobs, events, strict=True):
        got: list[Event] = []
        while sum(isinstance(e, Done | Failed) for e in got) < job.n and not any(
            isinstance(e, Failed) for e in got
        ):
            got.append(q.get(timeout=600))  # a hang guard only
        out.append(got)
    return out


def _job(model: LocalModel, i: int, **kw: object) -> tuple[Job, queue.Queue]:
    q: queue.Queue = queue.Queue()
    registers = [None, *model.registers]
    job = model.prepare(
        MESSAGES,
        registers[i % len(registers)],
        KNOBS[i % len(KNOBS)],
        SCHEMA if i % 2 else None,
        seed=100 + i,
        sink=q.put,
        **kw,  # type: ignore[arg-type]
    )
    return job, q


def _texts(events: list[Event]) -> dict[int, str]:
    return {e.choice: e.text for e in events if isinstance(e, Done)}


def test_a_seeded_request_says_the_same_alone_and_in_a_mixed_batch(model: LocalModel) -> None:
    pairs = [_job(model, i) for i in range(8)]
    steps_before, model.engine.metrics.largest_batch = model.engine.steps, 0
    together = _collect(model, [j for j, _ in pairs], [q for _, q in pairs])
    batched_steps = model.engine.steps - steps_before
    assert model.engine.metrics.largest_batch == 8  # all eight decoded in one batch
    for i, events in enumerate(together):
        job, q = _job(model, i)
        (alone,) = _collect(model, [job], [q])
        assert _texts(events) == _texts(alone), i
        # the streamed deltas add up to the final text
        assert "".join(e.text for e in events if isinstance(e, Delta)) == _texts(events)[0]
    assert batched_steps < sum(k.max_new_tokens for k in (KNOBS * 2))  # rows shared the steps


def test_a_prompt_joining_in_the_running_rows_forward_gives_the_logits_of_its_own_prefill(
    model: LocalModel,
) -> None:
    """The ragged step (joining prompts computed in the running rows' forward: each prompt's
    cached prefix laid out in place, per-segment causal attention and LoRA) against the separate
    prefill and merge it replaced, for every row and token: a LoRA row, a bare prompt with n=2,
    then, while they decode, a prompt whose prefix is cached and one with a grammar."""
    engine = model.engine
    assert engine.ragged  # the CPU attention on a Llama: the engine's path here
    knobs = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, max_new_tokens=40)
    other = [MESSAGES[0], {"role": "user", "content": "Speak of the water."}]

    def run(ragged: bool) -> tuple[dict[tuple[int, int, int], torch.Tensor], int]:
        first, second = (
            [model.prepare(m, r, knobs, g, seed, sink=lambda e: None, n=n) for m, r, g, seed, n in jobs]
            for jobs in (
                [(MESSAGES, model.registers[0], None, 10, 1), (other, None, None, 20, 2)],
                [(other, model.registers[0], None, 30, 1), (MESSAGES, model.registers[1], SCHEMA, 40, 1)],
            )
        )
        seen, choose, hits = {}, engine._choose, engine.prefixes.hits

        def record(rows: list[Any], logits: torch.Tensor) -> list[int]:
            for row, row_logits in zip(rows, logits, strict=True):
                seen[(row.job.seeds[0], row.choice, len(row.ids))] = row_logits.clone()
            return choose(rows, logits)

        engine._choose, engine.ragged = record, ragged  # type: ignore[method-assign]
        engine.prefixes.clear()
        try:
            if ragged:  # the second pair joins in a step that also decodes the first
                engine._step(first)
                for joining in ([], [], [], second, [], []):
                    engine._step(joining)
            else:
                for job in first:
                    engine._prefill(job)
                for _ in range(3):
                    engine._step([])
                for job in second:
                    engine._prefill(job)
                for _ in range(3):
                    engine._step([])
        finally:
            del engine._choose
            engine.ragged, engine.rows, engine.cache, engine.mask = True, [], None, None
        return seen, engine.prefixes.hits - hits

    assert not engine.rows
    want, want_hits = engine.call(lambda: run(False)).result()
    got, got_hits = engine.call(lambda: run(True)).result()
    assert got_hits == want_hits == 1  # the third prompt reused the first's cached prefix
    common = got.keys() & want.keys()
    # every row's first token, and the first pair's tokens before, at and after the join
    assert {(10, 0, 0), (20, 0, 0), (20, 1, 0), (30, 0, 0), (40, 0, 0), (10, 0, 4), (10, 0, 6)} <= common
    for key in sorted(common):
        torch.testing.assert_close(
            got[key], want[key], rtol=1e-4, atol=1e-4, msg=lambda m, k=key: f"{k}: {m}"
        )


def test_joining_prompts_are_capped_per_step_even_on_an_idle_engine(
    model: LocalModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine, joins = model.engine, []
    original = engine._join
    monkeypatch.setattr(engine, "_join", lambda jobs: (joins.append(len(jobs)), original(jobs))[1])

    def together(cap: int) -> list[int]:
        """Three requests queued while the decode thread is held, then let go at once."""
        joins.clear()
        monkeypatch.setattr(engine, "max_prefill_tokens", cap)
        gate = threading.Event()
        held = engine.call(gate.wait)
        pairs = [_job(model, i) for i in range(3)]
        for job, _ in pairs:
            engine.submit(job)
        gate.set()
        held.result()
        for _, q in pairs:
            while not isinstance(q.get(timeout=600), Done | Failed):  # a hang guard only
                pass
        return list(joins)

    assert together(4096) == [3]  # one ragged step computes the three prompts
    prompt = len(_job(model, 0)[0].prompt)
    assert together(prompt + 1) == [1, 1, 1]  # a budget of one prompt: one a step


def test_requests_join_a_running_batch_and_cancelled_rows_leave(model: LocalModel) -> None:
    long_knobs = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, max_new_tokens=200)
    first: queue.Queue = queue.Queue()
    job = model.prepare(MESSAGES, "caste-preacher", long_knobs, None, 1, sink=first.put)
    model.engine.submit(job)
    assert isinstance(first.get(timeout=600), Delta)  # the long row is decoding
    steps = model.engine.steps
    second, q = _job(model, 2)
    (events,) = _collect(model, [second], [q])
    assert isinstance(events[-1], Done)
    assert not job.cancelled and model.engine.rows  # the long row is still going: they ran together
    assert model.engine.steps - steps < 200
    job.cancel()
    deadline = time.monotonic() + 600
    while model.engine.rows and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not model.engine.rows and model.engine.cache is None  # the row left, its cache freed
    seen = []
    while not first.empty():
        seen.append(first.get())
    assert not any(isinstance(e, Done) for e in seen)


def test_n_rows_stop_strings_and_logprobs(model: LocalModel) -> None:
    job, q = _job(model, 0, n=3, logprobs=2)
    (events,) = _collect(model, [job], [q])
    done = [e for e in events if isinstance(e, Done)]
    assert sorted(e.choice for e in done) == [0, 1, 2]
    assert len({e.text for e in done}) > 1  # seeds seed, seed+1, seed+2
    for e in done:
        assert len(e.logprobs or []) == e.completion_tokens
        assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in e.logprobs or [])
    text = done[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    if stop.strip():
        again, q = _job(model, 0, stop=(stop,))
        (events,) = _collect(model, [again], [q])
        (end,) = [e for e in events if isinstance(e, Done)]
        assert end.finish_reason == "stop" and end.text == text[: text.find(stop)]


def test_a_streamed_row_sends_its_text_every_stream_interval_tokens(
    published: tuple[Path, Path], model: LocalModel
) -> None:
    long = SamplingKnobs(1.0, 1.0, 0, 1.0, 0.0, max_new_tokens=24)
    q: queue.Queue = queue.Queue()
    job = model.prepare(MESSAGES, "caste-preacher", long, None, seed=7, sink=q.put, logprobs=0)
    (coalesced,) = _collect(model, [job], [q])
    releases, trusted = published
    every = LocalModel.open(releases, "v1", trusted, settings=EngineSettings(stream_interval=1))
    try:
        q = queue.Queue()
        job = every.prepare(MESSAGES, "caste-preacher", long, None, seed=7, sink=q.put, logprobs=0)
        (per_token,) = _collect(every, [job], [q])
    finally:
        every.close()
    for events in (coalesced, per_token):
        (done,) = [e for e in events if isinstance(e, Done)]
        deltas = [e for e in events if isinstance(e, Delta)]
        assert "".join(d.text for d in deltas) == done.text  # nothing lost or repeated
        assert sum(len(d.logprobs) for d in deltas) == done.completion_tokens  # every token's logprob
    assert _texts(coalesced) == _texts(per_token)  # the interval changes when text is sent, not what
    assert {len(d.logprobs) for d in per_token if isinstance(d, Delta)} == {1}  # a delta per token
    sizes = [len(d.logprobs) for d in coalesced if isinstance(d, Delta)]
    interval = model.settings.stream_interval
    assert sizes[0] < interval  # the first text at once (time to first token unchanged)
    assert all(n <= interval for n in sizes) and max(sizes) == interval  # then every `interval` tokens
    assert cli._parser().parse_args(["serve", "--stream-interval", "1"]).stream_interval == 1
    with pytest.raises(SystemExit):  # argparse: "0: must be 1 or more"
        cli._parser().parse_args(["serve", "--stream-interval", "0"])


def test_ring_a_speaks_through_the_engine(model: LocalModel) -> None:
    catalogue = load_catalogue()
    ring = RingA(model)
    prompt = TurnPrompt(
        role=catalogue.get("drunk-scavenger").role,
        trait_vector=catalogue.get("drunk-scavenger").traits,
        affect_state=AffectState("calm"),
        memory_scope=MemoryScope(),
        turn_intent="answer",
        zone_context="the gate",
        player_utterance="Well?",
    )
    knobs = SamplingKnobs(0.7, 0.9, 40, 1.1, 0.0, max_new_tokens=96)
    before = model.engine.metrics.completion_tokens["drunk-scavenger"]
    replies = []
    threads = [
        threading.Thread(
            target=lambda: replies.append(
                ring.speak(prompt, catalogue.get("drunk-scavenger"), "drunk-scavenger", knobs)
            )
        )
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(replies) == 3 and all(r.adapter == "drunk-scavenger" for r in replies)
    assert model.engine.metrics.completion_tokens["drunk-scavenger"] - before == sum(
        r.completion_tokens for r in replies
    )
    for r in replies:
        if r.text and r.text.endswith("}"):
            import json

            validate(json.loads(r.text), TURN_SCHEMA)


def test_a_failing_step_fails_its_batch_and_the_engine_goes_on(
    model: LocalModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, calls = model.engine._forward, [0]

    def flaky(*args: object) -> torch.Tensor:  # the prefill passes, the first decode step breaks
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("the step broke")
        return original(*args)

    monkeypatch.setattr(model.engine, "_forward", flaky)
    job, q = _job(model, 0)
    (events,) = _collect(model, [job], [q])
    assert isinstance(events[-1], Failed) and "the step broke" in events[-1].message
    monkeypatch.undo()
    assert model.engine.alive and not model.engine.rows
    job, q = _job(model, 0)
    (events,) = _collect(model, [job], [q])
    assert isinstance(events[-1], Done)


def test_a_cached_prompt_prefix_changes_nothing(model: LocalModel) -> None:
    model.engine.prefixes.clear()
    hits = model.engine.prefixes.hits
    job, q = _job(model, 3)
    (cold,) = _collect(model, [job], [q])
    other = [{**MESSAGES[0]}, {"role": "user", "content": "Speak of the water."}]  # same system prefix
    job, q = _job(model, 3)
    (warm,) = _collect(model, [job], [q])
    assert _texts(cold) == _texts(warm) and model.engine.prefixes.hits == hits + 1
    q2: queue.Queue = queue.Queue()
    partial = model.prepare(other, model.registers[2], KNOBS[3], SCHEMA, seed=103, sink=q2.put)
    saved = model.engine.prefixes.tokens_saved
    (events,) = _collect(model, [partial], [q2])
    assert isinstance(events[-1], Done) and model.engine.prefixes.tokens_saved - saved >= 16
    model.engine.prefixes.clear()
    q3: queue.Queue = queue.Queue()
    again = model.prepare(other, model.registers[2], KNOBS[3], SCHEMA, seed=103, sink=q3.put)
    (fresh,) = _collect(model, [again], [q3])
    assert _texts(events) == _texts(fresh)  # the reused prefix equals a full prefill


def test_a_bfloat16_engine_serves_mixed_batches_close_to_float32(
    published: tuple[Path, Path], model: LocalModel
) -> None:
    releases, trusted = published
    with pytest.raises(NimmerError, match="float32, bfloat16, auto"):
        LocalModel.open(releases, "v1", trusted, settings=EngineSettings(dtype="float16"))
    assert cli._parser().parse_args(["serve", "--dtype", "bfloat16"]).dtype == "bfloat16"  # the CLI flag
    auto = serving_dtype("auto", "cpu")
    assert auto == (torch.bfloat16 if native_bf16("cpu") else torch.float32)
    half = LocalModel.open(releases, "v1", trusted, settings=EngineSettings(dtype="bfloat16", window_s=0.05))
    try:
        assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}
        assert half.engine.lora is not None
        assert all(layer.stacked_a.dtype == torch.float32 for layer in half.engine.lora.layers)  # on the CPU
        ids = torch.tensor([model.prompt_ids(MESSAGES)])

        def last_logits(engine: Any) -> torch.Tensor:  # on the decode thread, between its steps
            engine.lora.select(["caste-preacher", None])  # a LoRA row and a bare row in one forward
            return engine.inner(input_ids=ids.expand(2, -1)).logits[:, -1].float()

        want = model.engine.call(lambda: last_logits(model.engine)).result()
        got = half.engine.call(lambda: last_logits(half.engine)).result()
        # bfloat16 rounding moves a logit by ~0.01 here; dropping the LoRA would move it by ~1
        assert (want[0] - want[1]).abs().max() > 0.5 and (want - got).abs().max() < 0.1
        pairs = [_job(half, i) for i in range(4)]
        for events in _collect(half, [j for j, _ in pairs], [q for _, q in pairs]):
            assert isinstance(events[-1], Done)
    finally:
        half.close()
