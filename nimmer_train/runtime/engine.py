"""The generation engine behind Ring A and ``nimmer serve``: one decode thread owns the model and
runs every request in one batch, each row with its own register adapter (stacked LoRA, see
:mod:`nimmer_train.runtime.stacked_lora`), sampling knobs, seeded generator, stop conditions,
token budget and grammar.

Iteration-level batching: a request joins the running batch between two decode steps, left-padded
to the batch's length (the attention mask hides the padding, positions count each row's own
tokens); a row that finishes, or whose client went away, leaves at once and the padding no row
needs is trimmed. On a model whose attention takes a ragged step (the CPU's, see
:mod:`~nimmer_train.runtime.decode_attention`) the joining prompts are computed in the same forward
as the running rows' next tokens (mixed prefill and decode, as vLLM and Sarathi batch them): the
weights are read once for both, where a prefill of its own read them again and stalled every row
for a step's time (on SmolLM2-135M a 25-token prefill cost ~70 ms, two decode steps at a batch of
one). Elsewhere each request is prefilled alone (its ``n`` rows together) and its KV cache joins. When the
engine is idle the first request waits ``window_s`` for company. Requests arrive prepared
(:class:`Job`: tokenized, grammar compiled) by the caller's thread, so the CPU-heavy preparation
never runs on the decode thread; adapter loads run between steps (:meth:`Engine.call`). The decode
thread sets torch's intra-op threads (``threads``, default 1): measured on a loaded 2-core host,
a second OpenMP pool (the loader's) made two-thread decoding 50-200x slower, one thread none.

Events go to each job's ``sink`` from the decode thread: :class:`Delta` (streaming jobs only:
text safe to show, never half a UTF-8 character, never the start of a stop string; a row's first
text at once, then every ``stream_interval`` tokens and at its end), :class:`Done` per row,
:class:`Failed` for the whole job. Each event wakes the consumer's thread, and on this 2-core
machine waking a client thread for every token of every streamed row slowed SmolLM2's decode
steps at a batch of 8 from 44-47 ms to 70-77 ms (bfloat16); every 4 tokens, 47 ms (vLLM's
``--stream-interval`` makes the same trade).
"""

from __future__ import annotations

import collections
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from nimmer_train.errors import NimmerError
from nimmer_train.runtime.decode_attention import takes_ragged
from nimmer_train.runtime.serve_metrics import ServeMetrics
from nimmer_train.runtime.stacked_lora import StackedLora, lora_linears
from nimmer_train.voice.sampling import SamplingKnobs, sample_rows, warp_rows
from nimmer_train.voice.sentence_guard import ReplySentences, tracker

MAX_TOP_LOGPROBS = 20


class QueueFull(NimmerError):
    """The engine's waiting queue is at its bound; try again after ``retry_after_s``."""

    def __init__(self, waiting: int, retry_after_s: int) -> None:
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


class EngineClosed(NimmerError):
    """The engine is shutting down (or its thread died) and takes no new requests."""


class AdapterGone(NimmerError):
    """The job's register adapter was unloaded after the job was prepared."""


@dataclass(frozen=True)
class Delta:
    choice: int
    text: str
    logprobs: list[dict[str, Any]] = field(default_factory=list)  # the tokens this text came from


@dataclass(frozen=True)
class Done:
    choice: int
    finish_reason: str  # stop | length
    text: str
    completion_tokens: int
    logprobs: list[dict[str, Any]] | None


@dataclass(frozen=True)
class Failed:
    message: str


Event = Delta | Done | Failed


@dataclass
class Job:
    """One request, prepared off the decode thread; ``n`` rows share its prompt."""

    prompt: list[int]
    adapter: str | None  # the LoRA; None: the bare weights
    knobs: SamplingKnobs  # max_new_tokens: each row's budget
    seeds: list[int]  # one per row (choice)
    grammars: list[Any]  # one RowGrammar (or None) per row
    sink: Callable[[Event], None]
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; else how many top_logprobs per token
    register: str = "base"  # the metrics label
    stream: bool = True  # Delta events as text becomes safe to show; False: only Done
    cancelled: bool = False
    submitted: float = field(default_factory=time.perf_counter)

    @property
    def n(self) -> int:
        return len(self.seeds)

    def cancel(self) -> None:
        """Free the job's rows at the next step (a client that went away)."""
        self.cancelled = True


def random_seed() -> int:
    return random.SystemRandom().getrandbits(63)


@dataclass
class _Row:
    job: Job
    choice: int
    generator: torch.Generator
    grammar: Any
    ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0
    pending: list[dict[str, Any]] = field(default_factory=list)  # the last token's logprob entry
    unsent: list[dict[str, Any]] = field(default_factory=list)  # logprobs not yet streamed
    held: int = 0  # tokens since the last Delta
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish: str | None = None
    sentences: ReplySentences | None = None  # the sentence guard's count (max_sentence_repeats)


def _rows_of(job: Job) -> list[_Row]:
    """A job's rows (choices), each with its seeded generator and grammar."""
    return [
        _Row(job, i, torch.Generator().manual_seed(seed), grammar)
        for i, (seed, grammar) in enumerate(zip(job.seeds, job.grammars, strict=True))
    ]


_RAGGED_MASK = torch.ones(1, 1, 1, 1, dtype=torch.bool)  # a ragged forward's mask argument (unused)


def _pad_left(x: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    short = width - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class Engine:
    """One decode thread over ``model`` (a PEFT model with register LoRAs, or a plain one)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        stop_ids: list[int],
        max_batch: int = 16,
        window_s: float = 0.004,
        max_waiting: int = 64,
        max_prefill_tokens: int = 4096,
        threads: int = 1,
        prefix_cache_entries: int = 32,
        stream_interval: int = 4,
        metrics: ServeMetrics | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model, self.tokenizer, self.stop_ids = model, tokenizer, set(stop_ids)
        self.kv_dtype = kv_dtype  # the KV cache's dtype (None: the model's)
        self.inner = model.get_base_model() if hasattr(model, "get_base_model") else model
        self.lora = StackedLora(model) if lora_linears(model) else None
        self.ragged = takes_ragged(self.inner)  # joining prompts share the running rows' forward
        self.max_batch, self.window_s, self.max_waiting = max_batch, window_s, max_waiting
        self.max_prefill_tokens, self.threads = max_prefill_tokens, threads
        if stream_interval < 1:
            raise NimmerError(
                f"stream_interval {stream_interval}: a streamed row shows its text every >= 1 tokens"
            )
        self.stream_interval = stream_interval
        self.metrics = metrics or ServeMetrics()
        self.prefixes = PrefixCache(prefix_cache_entries)
        self.waiting: collections.deque[Job] = collections.deque()
        self.controls: collections.deque[tuple[Callable[[], Any], Future]] = collections.deque()
        self.rows: list[_Row] = []
        self.cache: Any = None
        self.mask: torch.Tensor | None = None
        self.cond = threading.Condition()
        self.closing = False
        self.error: BaseException | None = None
        self.steps = 0
        self.thread = threading.Thread(target=self._run, name="nimmer-engine", daemon=True)
        self.thread.start()

    # --- the caller's side -------------------------------------------------------------------

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def submit(self, job: Job) -> Job:
        """Queue ``job`` (its events go to ``job.sink``); QueueFull when more than ``max_waiting``
        rows would wait beyond the batch's room, EngineClosed when shutting down, AdapterGone
        when its adapter was unloaded since it was prepared. Returns the job (``cancel()`` frees
        its rows)."""
        if job.n > self.max_batch:
            raise NimmerError(f"n={job.n} is more rows than the engine's batch of {self.max_batch}")
        with self.cond:
            if self.closing or not self.alive:
                raise EngineClosed("the engine is shutting down; no new requests")
            loaded = self.lora.names if self.lora is not None else []
            if job.adapter is not None and job.adapter not in loaded:  # unloaded since prepared
                raise AdapterGone(f"no LoRA for register {job.adapter!r} is loaded any more")
            self._purge()  # a client that went away while queued holds no place in the queue
            queued = sum(j.n for j in self.waiting) + len(self.rows) + job.n - self.max_batch
            if queued > self.max_waiting:  # rows beyond the batch's room, this job's included
                raise QueueFull(len(self.waiting), self.retry_after_s())
            self.waiting.append(job)
            self.metrics.waiting = len(self.waiting)
            self.cond.notify_all()
        return job

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run ``fn`` on the decode thread between two steps (adapter loads); its Future."""
        future: Future = Future()
        with self.cond:
            if not self.alive:
                raise EngineClosed("the engine is not running")
            self.controls.append((fn, future))
            self.cond.notify_all()
        return future

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        """Stop taking requests; with ``drain`` finish every accepted one first, else fail them."""
        dropped: list[Job] = []
        with self.cond:
            self.closing = True
            if not drain:
                dropped = [*self.waiting, *{id(r.job): r.job for r in self.rows}.values()]
                for job in dropped:
                    job.cancel()
            self.cond.notify_all()
        for job in dropped:
            self._emit(job, Failed("the server shut down before this request finished"))
        self.thread.join(timeout)

    def _purge(self) -> None:
        """Drop the cancelled jobs from the queue (caller holds ``cond``)."""
        if any(j.cancelled for j in self.waiting):
            self.waiting = collections.deque(j for j in self.waiting if not j.cancelled)
            self.metrics.waiting = len(self.waiting)

    def room(self) -> int:
        """Rows the engine would still accept now: the batch's free room plus the queue's."""
        with self.cond:
            self._purge()
            return self.max_batch + self.max_waiting - len(self.rows) - sum(j.n for j in self.waiting)

    def retry_after_s(self) -> int:
        """What a refused client should wait: about one turn's mean latency, at least 1 s."""
        return max(1, round(self.metrics.e2e.mean() or 1.0))

    # --- the decode thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            torch.set_num_threads(self.threads)
            with torch.inference_mode():
                while self._wait():
                    self._controls()
                    joining = self._admit()
                    if self.rows or joining:
                        try:
                            self._step(joining)
                        except Exception as exc:  # this batch fails; the engine goes on
                            self._fail_batch(exc, joining)
        except BaseException as exc:  # the thread must not die silently: fail everyone, say why
            self.error = exc
            message = f"the generation engine failed: {type(exc).__name__}: {exc}"
            with self.cond:
                jobs = {id(r.job): r.job for r in self.rows} | {id(j): j for j in self.waiting}
                self.rows, self.waiting = [], collections.deque()
            for job in jobs.values():
                self._emit(job, Failed(message))
            raise

    def _fail_batch(self, exc: Exception, joining: list[Job]) -> None:
        jobs = {id(r.job): r.job for r in self.rows} | {id(j): j for j in joining}
        self.rows, self.cache, self.mask = [], None, None
        for job in jobs.values():
            self._emit(job, Failed(f"{type(exc).__name__}: {exc}"))

    def _wait(self) -> bool:
        """Block until there is work; False once closing and nothing is left."""
        with self.cond:
            while not (self.rows or self.waiting or self.controls):
                if self.closing:
                    return False
                self.cond.wait()
            if not self.rows and self.waiting and self.window_s:  # idle: wait a moment for company
                deadline = time.perf_counter() + self.window_s
                while sum(j.n for j in self.waiting) < self.max_batch and not self.closing:
                    left = deadline - time.perf_counter()
                    if left <= 0:
                        break
                    self.cond.wait(left)
            return True

    def _controls(self) -> None:
        while self.controls:
            with self.cond:
                fn, future = self.controls.popleft()
            try:
                future.set_result(fn())
            except Exception as exc:
                future.set_exception(exc)

    def _admit(self) -> list[Job]:
        """Take the waiting jobs the batch has room for; those to join at the next step (a ragged
        one), or none (each prefilled here)."""
        taken: list[Job] = []
        with self.cond:
            self._purge()
            room, tokens = self.max_batch - len(self.rows), 0
            while self.waiting and self.waiting[0].n <= room:
                over = tokens and tokens + len(self.waiting[0].prompt) > self.max_prefill_tokens
                if over and (self.rows or self.ragged):
                    break  # a long prefill stalls every running row (a ragged step computes the
                    # prompts in one forward): the rest join at the next step
                job = self.waiting.popleft()
                if job.cancelled:
                    continue
                taken.append(job)
                room -= job.n
                tokens += len(job.prompt)
            self.metrics.waiting = len(self.waiting)
        joining = []
        for job in taken:
            try:
                if self.ragged:
                    if self.lora is not None:
                        self.lora.slot(job.adapter)  # its adapter is still loaded
                    elif job.adapter is not None:
                        raise NimmerError("this model has no LoRA adapters loaded")
                    joining.append(job)
                else:
                    self._prefill(job)
            except Exception as exc:
                self._emit(job, Failed(str(exc)))
        self._sweep()
        return joining

    def _select(
        self, adapters: list[str | None], segments: list[tuple[str | None, int]] | None = None
    ) -> None:
        if self.lora is not None:
            self.lora.select(adapters, segments or ())
        elif any(a is not None for a in [*adapters, *(a for a, _ in segments or ())]):
            raise NimmerError("this model has no LoRA adapters loaded")

    def _forward(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any, ragged: Any = None
    ) -> Any:
        """The logits of each row's last position. The last position is gathered by index (a fresh
        tensor), not sliced: torch's bfloat16 linear took 190 ms for the output layer on a sliced
        ``[1, 1, hidden]`` view of a prefill (11 ms on a fresh one; SmolLM2's 49k-token vocabulary).
        ``ragged`` (kv_cache.Ragged): ``ids`` ``[1, tokens]`` are a ragged step's; the logits of the
        positions ``mask`` lists (each running row's token, each joining prompt's last)."""
        if ragged is not None:
            for layer in cache.layers:
                layer.ragged = ragged  # where each token's keys and values go
            try:
                out = self.inner(
                    input_ids=ids,
                    attention_mask=_RAGGED_MASK,  # 4-D: taken as is; the attention masks by the plan
                    position_ids=positions,
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=mask,
                    ragged=ragged,
                )
            finally:
                for layer in cache.layers:
                    layer.ragged = None
                if self.lora is not None:
                    self.lora.clear_segments()
            return out.logits[0].float()
        out = self.inner(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=torch.tensor([ids.shape[1] - 1]),
        )
        return out.logits[:, -1].float()

    def _prefill(self, job: Job) -> None:
        from nimmer_train.runtime.kv_cache import growing_cache  # transformers: on first use

        n, length = job.n, len(job.prompt)
        self._select([job.adapter] * n)
        cache = growing_cache(self.inner.config, self.kv_dtype)
        start = self.prefixes.reuse(job.adapter, job.prompt, cache, n)
        ids = torch.tensor([job.prompt[start:]] * n, dtype=torch.long)
        mask = torch.ones(n, length, dtype=torch.long)
        logits = self._forward(ids, mask, torch.arange(start, length).expand(n, -1), cache)
        self.prefixes.keep(
            job.adapter, job.prompt, [(layer.keys[:1], layer.values[:1]) for layer in cache.layers]
        )
        rows = _rows_of(job)
        tokens = self._choose(rows, logits)
        self._merge(cache, mask)
        self.rows.extend(rows)
        self.metrics.started(job.register, length, time.perf_counter() - job.submitted)
        for row, token in zip(rows, tokens, strict=True):
            self._advance(row, token)

    def _merge(self, cache: Any, mask: torch.Tensor) -> None:
        """Join a prefilled cache to the running batch, the shorter side left-padded."""
        if self.cache is None or self.mask is None:
            self.cache, self.mask = cache, mask
            return
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            if hasattr(mine, "join") and type(mine) is type(theirs):  # kv_cache.GrowingLayer
                mine.join(theirs, width)  # one copy into a buffer with room
                continue
            mine.keys = torch.cat([_pad_left(mine.keys, width, 2), _pad_left(theirs.keys, width, 2)])
            mine.values = torch.cat([_pad_left(mine.values, width, 2), _pad_left(theirs.values, width, 2)])
        self.mask = torch.cat([_pad_left(self.mask, width, 1), _pad_left(mask, width, 1)])

    def _join(self, jobs: list[Job]) -> None:
        """One ragged forward: the running rows' next tokens and what the joining jobs' prompts
        have beyond their cached prefixes; each job's rows join the batch with their first token."""
        from nimmer_train.runtime.kv_cache import Ragged, Segment, growing_cache

        rows, old = len(self.rows), self.mask
        if self.cache is None or old is None:
            self.cache, rows = growing_cache(self.inner.config, self.kv_dtype), 0
        width = max([len(j.prompt) for j in jobs] + ([old.shape[1] + 1] if rows and old is not None else []))
        layers = self.cache.layers
        parts: list[list[tuple[Any, Any, int, int]]] = [[] for _ in layers]  # the joining rows'
        masks, ids, positions, segments = [], [r.ids[-1] for r in self.rows], [], []
        if rows and old is not None:  # the running rows keep their place, their next column free
            masks.append(_pad_left(torch.cat([old, old.new_ones(rows, 1)], dim=1), width, 1))
            positions = old.sum(dim=1).tolist()
        row = rows
        for job in jobs:
            start, kept = self.prefixes.find(job.adapter, job.prompt)
            seg = Segment(row, job.n, len(job.prompt) - start, len(job.prompt))
            for i, part in enumerate(parts):
                k, v = (kept[i][0][:, :, :start], kept[i][1][:, :, :start]) if kept else (None, None)
                part.append((k, v, job.n, width - seg.tokens))
            masks.append(_pad_left(torch.ones(job.n, seg.length, dtype=torch.long), width, 1))
            ids += job.prompt[start:]
            positions += range(start, seg.length)
            segments.append(seg)
            row += job.n
        config = self.inner.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        like = torch.empty(0, config.num_key_value_heads, 0, dim, dtype=self.kv_dtype or self.inner.dtype)
        for layer, part in zip(layers, parts, strict=True):
            layer.extend(part, width, own_end=width - 1, like=like)
        self.mask = torch.cat(masks)
        plan = Ragged(
            rows, tuple(segments), width, self.mask[:rows].bool()[:, None, None, :] if rows else None
        )
        self._select(
            [r.job.adapter for r in self.rows],
            [(j.adapter, s.tokens) for j, s in zip(jobs, segments, strict=True)],
        )
        ends = torch.tensor([s.tokens for s in segments]).cumsum(0) + rows - 1
        keep = torch.cat([torch.arange(rows), ends])
        logits = self._forward(torch.tensor([ids]), keep, torch.tensor([positions]), self.cache, plan)
        joined, chosen = [], [logits[:rows]]
        for i, (job, seg) in enumerate(zip(jobs, segments, strict=True)):
            prompt = [
                (
                    layer.keys[seg.row : seg.row + 1, :, width - seg.length :],
                    layer.values[seg.row : seg.row + 1, :, width - seg.length :],
                )
                for layer in layers
            ]
            self.prefixes.keep(job.adapter, job.prompt, prompt)
            joined += _rows_of(job)
            chosen.append(logits[rows + i].expand(job.n, -1))
        if rows:
            self.steps += 1
            self.metrics.batch(rows)
        everyone = self.rows + joined
        tokens = self._choose(everyone, torch.cat(chosen))
        self.rows = everyone
        for job in jobs:
            self.metrics.started(job.register, len(job.prompt), time.perf_counter() - job.submitted)
        for r, token in zip(everyone, tokens, strict=True):
            self._advance(r, token)
        self._sweep()

    def _step(self, joining: list[Job]) -> None:
        if joining:
            self._join(joining)
            return
        assert self.mask is not None
        self.steps += 1
        self.metrics.batch(len(self.rows))
        self._select([r.job.adapter for r in self.rows])
        last = torch.tensor([[r.ids[-1]] for r in self.rows], dtype=torch.long)
        positions = self.mask.sum(dim=1, keepdim=True)
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(self.rows), 1)], dim=1)
        logits = self._forward(last, self.mask, positions, self.cache)
        for row, token in zip(self.rows, self._choose(self.rows, logits), strict=True):
            self._advance(row, token)
        self._sweep()

    def _sweep(self) -> None:
        """Drop finished and cancelled rows from the batch and trim padding no row needs."""
        keep = [i for i, r in enumerate(self.rows) if r.finish is None and not r.job.cancelled]
        if len(keep) == len(self.rows):
            return
        for i, row in enumerate(self.rows):
            if i not in keep and row.finish is None:  # cancelled: its client is gone
                self.metrics.cancelled(row.job.register)
        self.rows = [self.rows[i] for i in keep]
        if not keep or self.mask is None:
            self.cache, self.mask = None, None
            return
        index = torch.tensor(keep, dtype=torch.long)
        mask = self.mask.index_select(0, index)
        start = int(mask.any(dim=0).int().argmax())
        self.mask = mask[:, start:]
        for layer in self.cache.layers:
            if hasattr(layer, "keep_rows"):  # kv_cache.GrowingLayer: in place
                layer.keep_rows(keep, start)
                continue
            layer.keys = layer.keys.index_select(0, index)[:, :, start:]
            layer.values = layer.values.index_select(0, index)[:, :, start:]

    def _choose(self, rows: list[_Row], logits: torch.Tensor) -> list[int]:
        """Each row's next token: its grammar's mask, its knobs, its generator."""
        raw = torch.log_softmax(logits, dim=-1) if any(r.job.logprobs is not None for r in rows) else None
        scores = logits
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if constrained:
            scores = scores.clone()
            for i in constrained:
                allowed = rows[i].grammar.allowed(len(rows[i].ids), scores.shape[-1])
                scores[i].masked_fill_(~allowed, float("-inf"))
        banned = [self._sentence_bans(r) for r in rows]
        scores = warp_rows(scores, [r.job.knobs for r in rows], [r.ids for r in rows], banned)
        dead = torch.isneginf(scores).all(dim=-1)
        if bool(dead.any()):  # nothing allowed (a grammar in error): end the row, never sample NaN
            for i in dead.nonzero().flatten().tolist():
                rows[i].finish = "stop"
            scores = scores.masked_fill(dead[:, None], 0.0)
        tokens = sample_rows(scores, [r.generator for r in rows])
        if raw is not None:
            for i, row in enumerate(rows):
                if row.job.logprobs is not None:
                    row.pending.append(self._logprob(raw[i], tokens[i], row.job.logprobs))
        return tokens

    def _sentence_bans(self, row: _Row) -> set[int]:
        """The tokens that would end a sentence ``row`` said its ``max_sentence_repeats`` times."""
        limit = row.job.knobs.max_sentence_repeats
        if row.sentences is None and limit:
            row.sentences = tracker(self.tokenizer, self.stop_ids, limit, row.grammar is not None)
        return row.sentences.bans(row.ids) if row.sentences is not None else set()

    def _logprob(self, raw: torch.Tensor, token: int, top: int) -> dict[str, Any]:
        """OpenAI's logprob entry: the model's own log-probabilities (before knobs and grammar)."""

        def entry(t: int, value: float) -> dict[str, Any]:
            text = self.tokenizer.decode([t])
            return {"token": text, "logprob": value, "bytes": list(text.encode("utf-8"))}

        out = entry(token, float(raw[token]))
        if top:
            values, ids = raw.topk(min(top, MAX_TOP_LOGPROBS))
            out["top_logprobs"] = [entry(int(t), float(v)) for v, t in zip(values, ids, strict=True)]
        else:
            out["top_logprobs"] = []
        return out

    def _advance(self, row: _Row, token: int) -> None:
        """Append ``token`` to ``row``, decide whether it finished, send what is safe to show."""
        job = row.job
        if row.finish is None:
            row.ids.append(token)
            if row.grammar is not None:
                row.grammar.consume(token)
        if token in self.stop_ids:
            row.finish = row.finish or "stop"
        elif len(row.ids) >= job.knobs.max_new_tokens:
            row.finish = row.finish or "length"
        if job.logprobs is not None:
            row.logprobs.extend(row.pending)
            row.unsent.extend(row.pending)
        row.pending = []
        row.held += 1
        # a streamed row shows its text every ``stream_interval`` tokens (its first text at once)
        due = job.stream and (row.emitted == 0 or row.held >= self.stream_interval)
        if not (due or job.stop or row.finish):
            return  # nothing to show or to look for yet: no decode, no event
        text = self.tokenizer.decode(row.ids, skip_special_tokens=True)
        for stop in job.stop:
            at = text.find(stop, max(0, row.emitted - len(stop)))
            if at >= 0:
                text, row.finish = text[:at], "stop"
        row.text = text
        if job.stream and (due or row.finish):
            safe = len(text) if row.finish else _safe_end(text, job.stop)
            if safe > row.emitted or row.unsent:
                self._emit(job, Delta(row.choice, text[row.emitted : max(safe, row.emitted)], row.unsent))
                row.emitted, row.unsent, row.held = max(safe, row.emitted), [], 0
        if row.finish:
            lp = row.logprobs if job.logprobs is not None else None
            self._emit(job, Done(row.choice, row.finish, text, len(row.ids), lp))
            self.metrics.finished(job.register, len(row.ids), row.finish, time.perf_counter() - job.submitted)

    def _emit(self, job: Job, event: Event) -> None:
        try:
            job.sink(event)
        except Exception:  # the consumer is gone (a closed event loop): free its rows
            job.cancel()


class PrefixCache:
    """The KV of recent prompts per adapter (least recently used dropped past ``entries`` or
    ``max_bytes``, 256 MiB): a new
    prompt prefills only what follows its longest common prefix with one of them (vLLM's
    automatic prefix caching, per register: the KV depends on the adapter). Cleared whenever an
    adapter is loaded or unloaded."""

    MIN_TOKENS = 16  # a shorter common prefix is not worth the copy

    def __init__(self, entries: int, max_bytes: int = 256 * 2**20) -> None:
        self.entries, self.max_bytes = entries, max_bytes
        self.kept: collections.OrderedDict[tuple[Any, ...], list[tuple[torch.Tensor, torch.Tensor]]] = (
            collections.OrderedDict()
        )
        self.hits = self.tokens_saved = 0

    def clear(self) -> None:
        self.kept.clear()

    def reuse(self, adapter: str | None, prompt: list[int], cache: Any, n: int) -> int:
        """Fill ``cache`` (``n`` rows) with the longest cached prefix of ``prompt``; its length."""
        best, kept = self.find(adapter, prompt)
        for i, (keys, values) in enumerate(kept or []):
            cache.update(
                keys[:, :, :best].expand(n, -1, -1, -1), values[:, :, :best].expand(n, -1, -1, -1), i
            )
        return best

    def find(
        self, adapter: str | None, prompt: list[int]
    ) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]] | None]:
        """The length of the longest cached prefix of ``prompt`` (0 when none is worth it) and the
        keys and values per layer that hold it (``[1, kv_heads, >= length, dim]``)."""
        best, best_key = 0, None
        for key in self.kept:
            if key[0] != adapter:
                continue
            same = 0
            for a, b in zip(key[1], prompt, strict=False):
                if a != b:
                    break
                same += 1
            if same > best:
                best, best_key = same, key
        best = min(best, len(prompt) - 1)  # at least one token to prefill: its logits are needed
        if best_key is None or best < self.MIN_TOKENS:
            return 0, None
        self.kept.move_to_end(best_key)
        self.hits += 1
        self.tokens_saved += best
        return best, self.kept[best_key]

    def keep(
        self, adapter: str | None, prompt: list[int], kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        """Keep ``prompt``'s keys and values, per layer ``[1, kv_heads, len(prompt), dim]``."""
        if self.entries <= 0:
            return
        key = (adapter, tuple(prompt))
        self.kept[key] = [(keys.clone(), values.clone()) for keys, values in kv]
        self.kept.move_to_end(key)
        while len(self.kept) > self.entries or (len(self.kept) > 1 and self.nbytes() > self.max_bytes):
            self.kept.popitem(last=False)

    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for kv in self.kept.values() for k, v in kv)


def _safe_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of ``text`` can be shown while generation goes on: not a trailing partial UTF-8
    character (U+FFFD from byte-level BPE), not a suffix that may begin a stop string."""
    end = len(text.rstrip("\ufffd"))
    hold = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, end), 0, -1):
            if text[:end].endswith(stop[:k]):
                hold = max(hold, k)
                break
    return end - hold
