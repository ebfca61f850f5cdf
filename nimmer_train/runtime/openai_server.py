"""``nimmer serve``: an OpenAI-compatible HTTP server over one verified version (Ring B), every
request decoded by the model's batching engine (:mod:`nimmer_train.runtime.engine`).

- ``GET /v1/models`` lists the version and one ``<version>:<register>`` entry per loaded LoRA, as
  vLLM lists LoRA modules.
- ``POST /v1/chat/completions`` applies the adapter the ``model`` field names; honours
  temperature, top_p, top_k, min_p, repetition_penalty, ``no_repeat_ngram_size`` (HF's name, an
  extension), ``max_sentence_repeats`` (an extension), max_tokens, seed, ``stop``, ``n``,
  ``logprobs``/``top_logprobs``; enforces ``response_format`` (``json_schema`` or
  ``json_object``) while decoding; ``stream: true`` answers with Server-Sent Events in OpenAI's
  chunk format (``stream_options.include_usage`` adds the usage chunk; then ``data: [DONE]``; an
  error mid-stream is an ``error`` object). A client that disconnects, streaming or not, frees
  its rows at once.
- ``GET /health``: 503 while the model loads or once the engine has stopped, else 200.
- ``GET /metrics``: Prometheus text (:mod:`nimmer_train.runtime.serve_metrics`).
- A full queue answers 429 with ``Retry-After``; shutdown finishes the turns already accepted.
- With ``reload`` (``nimmer serve --reload-s``): the served alias is resolved again every few
  seconds; when it moves, the new version is loaded beside the old one and swapped in: turns in
  flight finish on the old model, new turns go to the new one, and the old one closes once its
  last turn is done. A version that fails to load or verify is logged and the old one stays.
- With ``adapter_updates``: ``POST /v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``
  ``{"lora_name": "<register>"}``, only for LoRAs the signed version registry says fit.

Requests are checked by :mod:`nimmer_train.runtime.request_limits` before the engine sees them.
Template and grammar work runs on one preparation thread, never on the decode thread.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from nimmer_train.errors import NimmerError
from nimmer_train.runtime.engine import AdapterGone, Delta, Done, EngineClosed, Failed, Job, QueueFull
from nimmer_train.runtime.local_model import AdapterBusy, EngineSettings, LocalModel
from nimmer_train.runtime.request_limits import (
    ChatRequest,
    RequestError,
    SchemaCache,
    ServeLimits,
    check_bearer,
    check_chat,
    read_json,
)

log = logging.getLogger(__name__)


def _error(status: int, message: str, code: str, param: str | None = None, **headers: str) -> JSONResponse:
    return JSONResponse(
        RequestError(status, message, code, param).body(), status_code=status, headers=headers
    )


def _busy(retry_after_s: int, preparing: int) -> JSONResponse:
    """429 before a request is prepared: the ones already being prepared fill the engine's room."""
    return _error(
        429,
        f"the server is busy: {preparing} rows are being prepared and the queue is full; "
        f"retry in {retry_after_s} s",
        "rate_limit_exceeded",
        **{"Retry-After": str(retry_after_s)},
    )


def model_ids(model: LocalModel) -> list[str]:
    return [model.label, *(f"{model.label}:{r}" for r in model.registers)]


def prompt_tokens(model: LocalModel, messages: list[dict[str, str]]) -> int:
    """The prompt's length in the model's tokens, as generation will see it."""
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return len(ids)


class _Holder:
    """The model once loaded (a loader runs in a thread at start-up: /health says 503 meanwhile)."""

    def __init__(self, model: LocalModel | Callable[[], LocalModel]) -> None:
        loader = callable(model) and not hasattr(model, "engine")
        self.model: LocalModel | None = None if loader else model  # type: ignore[assignment]
        self.loader = model if loader else None
        self.owned = self.model is None  # loaded here: closed here
        self.error: str | None = None
        self.users: collections.Counter = collections.Counter()  # id(model) -> turns on it now
        self.retiring: set[asyncio.Task] = set()  # old models waiting for their last turn
        self.reload_error: str | None = None

    def load(self) -> None:
        try:
            self.model = self.loader()  # type: ignore[misc]
        except Exception as exc:
            log.exception("loading the model failed")
            self.error = f"{type(exc).__name__}: {exc}"

    def acquire(self) -> LocalModel:
        """The model a new turn runs on, counted until :meth:`release` (it may be swapped out
        meanwhile; it is closed only once its last turn is released)."""
        assert self.model is not None
        self.users[id(self.model)] += 1
        return self.model

    def release(self, model: LocalModel) -> None:
        self.users[id(model)] -= 1
        if self.users[id(model)] <= 0:
            del self.users[id(model)]

    async def released(self, chunks: AsyncIterator[Any], model: LocalModel) -> AsyncIterator[Any]:
        """A streamed body that releases ``model`` when it ends, however it ends."""
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.release(model)

    async def follow(self, reload: Reload) -> None:
        """Every ``reload.interval_s``: resolve the served name; when it names another version,
        load it (in a thread) and swap it in; the old model retires in the background. A server
        whose first load failed (/health 503) recovers once the name points at a good version."""
        failed: str | None = None
        while True:
            await asyncio.sleep(reload.interval_s)
            current = self.model
            if current is None and self.error is None:  # the first load is still running
                continue
            try:
                label = await asyncio.to_thread(reload.resolve)
            except Exception as exc:  # a registry being written, a bad alias: try again later
                log.warning("resolving the served version failed: %s", exc)
                continue
            serving = current.label if current is not None else None
            if label in (serving, failed):
                continue
            try:
                new = await asyncio.to_thread(reload.load, label)
            except Exception as exc:
                log.exception("loading %s failed; still serving %s", label, serving or "nothing")
                failed, self.reload_error = label, f"{label}: {type(exc).__name__}: {exc}"
                continue
            failed, self.reload_error, self.error = None, None, None
            owned, self.model, self.owned = self.owned, new, True
            log.warning("the served alias moved: now serving %s (was %s)", new.label, serving or "nothing")
            if current is not None:
                task = asyncio.create_task(self.retire(current, owned, reload.drain_s))
                self.retiring.add(task)
                task.add_done_callback(self.retiring.discard)

    async def retire(self, model: LocalModel, owned: bool, drain_s: float) -> None:
        """Close ``model`` once no turn runs on it (or after ``drain_s``, finishing what its
        engine accepted)."""
        deadline = time.monotonic() + drain_s
        while self.users.get(id(model)) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if owned:
            await asyncio.to_thread(model.close)


@dataclass(frozen=True)
class Reload:
    """Follow what ``resolve`` names (an alias's version label now) and ``load`` it when it moves."""

    resolve: Callable[[], str]
    load: Callable[[str], LocalModel]
    interval_s: float = 5.0
    drain_s: float = 600.0  # an old model waits this long for its last turn before it closes

    @classmethod
    def alias(
        cls,
        releases: Path,
        name: str,
        trusted_keys: Path,
        interval_s: float = 5.0,
        settings: EngineSettings | None = None,
    ) -> Reload:
        """Follow ``name`` (an alias, or a fixed label) in the registry of ``releases``; each
        version is served with ``settings``."""
        from nimmer_train.publish.registry import Registry

        def resolve() -> str:
            registry = Registry.open(releases)
            try:
                return registry.find(name).label
            finally:
                registry.close()

        return cls(
            resolve,
            lambda label: LocalModel.open(releases, label, trusted_keys, settings=settings),
            interval_s,
        )


@dataclass(frozen=True)
class _Serving:
    """What the routes of one app share."""

    holder: _Holder
    limits: ServeLimits
    schemas: SchemaCache
    prep: ThreadPoolExecutor  # templates, grammars: off the decode thread
    created: int
    preparing: collections.Counter  # rows of requests being prepared, not yet in the engine


def create_app(
    model: LocalModel | Callable[[], LocalModel],
    api_key: str | None = None,
    limits: ServeLimits | None = None,
    adapter_updates: bool = False,
    reload: Reload | None = None,
) -> FastAPI:
    """The server over ``model`` (or over what the callable loads, in a thread at start-up);
    with ``api_key`` every route but /health needs ``Authorization: Bearer``; with ``reload`` it
    follows an alias (see the module docstring)."""
    limits = limits or ServeLimits()
    serving = _Serving(
        holder=_Holder(model),
        limits=limits,
        schemas=SchemaCache(limits.schema_cache_size),
        prep=ThreadPoolExecutor(1, thread_name_prefix="nimmer-prep"),
        created=int(time.time()),
        preparing=collections.Counter(),
    )
    app = FastAPI(title="nimmer serve", version="2", lifespan=_lifespan(serving, reload))
    app.state.schemas = serving.schemas
    app.state.holder = serving.holder
    _add_authentication(app, serving.holder, api_key)
    _add_status_routes(app, serving)
    _add_chat_route(app, serving)
    if adapter_updates:
        _add_adapter_routes(app, serving)
    return app


def _lifespan(serving: _Serving, reload: Reload | None) -> Callable[[FastAPI], Any]:
    """Start-up loads the model (in a thread) and follows the alias; shutdown finishes every
    accepted turn, lets retiring models close, and closes the model it loaded."""
    holder = serving.holder

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if holder.loader is not None:
            threading.Thread(target=holder.load, name="nimmer-load", daemon=True).start()
        follow = asyncio.create_task(holder.follow(reload)) if reload is not None else None
        yield
        if follow is not None:
            follow.cancel()
        for task in list(holder.retiring):  # old models finish their turns and close
            await task
        if holder.model is not None:  # graceful: every accepted turn finishes
            engine = holder.model.engine
            while engine.alive and (engine.rows or engine.waiting):
                await asyncio.sleep(0.05)
            if holder.owned:
                await asyncio.to_thread(holder.model.close)
        serving.prep.shutdown(wait=False)

    return lifespan


def _add_authentication(app: FastAPI, holder: _Holder, api_key: str | None) -> None:
    """Every route but /health needs the bearer key (when there is one); /v1/ waits for the model."""

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Any:
        if request.url.path != "/health":
            try:
                check_bearer(request.headers.get("authorization"), api_key)
            except RequestError as exc:
                return JSONResponse(
                    exc.body(), status_code=exc.status, headers={"WWW-Authenticate": "Bearer"}
                )
        if holder.model is None and request.url.path.startswith("/v1/"):
            why = holder.error or "the model is loading"
            return _error(503, f"not ready: {why}", "not_ready", **{"Retry-After": "5"})
        return await call_next(request)


def _add_status_routes(app: FastAPI, serving: _Serving) -> None:
    """/health, /metrics and /v1/models."""
    holder = serving.holder

    @app.get("/health")
    def health() -> JSONResponse:
        if holder.model is None:
            return JSONResponse({"status": "error" if holder.error else "loading"}, status_code=503)
        engine = holder.model.engine
        if not engine.alive or engine.closing:
            return JSONResponse({"status": "stopping" if engine.alive else "engine_failed"}, status_code=503)
        if holder.reload_error:  # still serving the old version; the new one failed to load
            return JSONResponse(
                {"status": "ok", "model": holder.model.label, "reload_error": holder.reload_error}
            )
        return JSONResponse({"status": "ok", "model": holder.model.label})

    @app.get("/metrics")
    def metrics() -> PlainTextResponse:
        if holder.model is None:
            return PlainTextResponse("", status_code=503)
        engine = holder.model.engine
        text = engine.metrics.render(len(engine.rows), len(engine.waiting))
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        assert holder.model is not None
        return _model_list(holder.model, serving.created)


def _add_chat_route(app: FastAPI, serving: _Serving) -> None:
    """POST /v1/chat/completions: the turn stays on the model it started on, whatever alias moves
    meanwhile; that model is released when the reply (or its stream) ends."""
    holder = serving.holder

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Any:
        m = holder.acquire()
        try:
            response = await _answer(serving, m, request)
        except BaseException:
            holder.release(m)
            raise
        if isinstance(response, StreamingResponse):
            response.body_iterator = holder.released(response.body_iterator, m)
        else:
            holder.release(m)
        return response


def _add_adapter_routes(app: FastAPI, serving: _Serving) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    holder = serving.holder

    @app.post("/v1/load_lora_adapter")
    async def load_adapter(request: Request) -> JSONResponse:
        return await _adapter_route(holder.model, request, serving.limits, load=True)

    @app.post("/v1/unload_lora_adapter")
    async def unload_adapter(request: Request) -> JSONResponse:
        return await _adapter_route(holder.model, request, serving.limits, load=False)


async def _answer(serving: _Serving, m: LocalModel, request: Request) -> Any:
    """One chat turn on ``m``: admitted and prepared, handed to the engine, answered (streamed or
    whole)."""
    events: asyncio.Queue = asyncio.Queue()
    prepared = await _admit(serving, m, request, events)
    if isinstance(prepared, Response):
        return prepared
    req, job = prepared
    refused = _submit(m, job)
    if refused is not None:
        return refused
    if req.stream:
        return StreamingResponse(
            _stream(m, req, job, events),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    return await _reply(m, req, job, events, request)


async def _admit(
    serving: _Serving, m: LocalModel, request: Request, events: asyncio.Queue
) -> tuple[ChatRequest, Job] | Response:
    """Read the body, refuse it unprepared when the engine has no room for its rows, else prepare
    it on the preparation thread; its events go to ``events``."""
    loop = asyncio.get_running_loop()

    def sink(event: Any) -> None:
        loop.call_soon_threadsafe(events.put_nowait, event)

    try:
        body = await read_json(request, serving.limits)  # (size-capped) before it counts: a slow
    except RequestError as exc:  # upload holds no place in the engine's room
        return JSONResponse(exc.body(), status_code=exc.status)
    n = body.get("n", 1) if isinstance(body, dict) else 1
    rows = n if isinstance(n, int) and 1 <= n <= m.engine.max_batch else 1  # (bad n: a 400 below)
    preparing = serving.preparing
    if preparing["rows"] + rows > m.engine.room():  # the engine could not take them all:
        return _busy(m.engine.retry_after_s(), preparing["rows"])  # refuse now, unprepared
    preparing["rows"] += rows
    try:
        return await loop.run_in_executor(
            serving.prep, _prepare, m, body, serving.limits, serving.schemas, sink
        )
    except RequestError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    except ValueError as exc:  # a schema the engine's grammar cannot use after all
        return _error(400, str(exc), "invalid_response_format", "response_format")
    except NimmerError as exc:  # e.g. a register unloaded since the check
        return _error(404, str(exc), "model_not_found", "model")
    finally:
        preparing["rows"] -= rows


def _submit(m: LocalModel, job: Job) -> JSONResponse | None:
    """Hand ``job`` to the engine; the error reply when it refuses."""
    try:
        m.engine.submit(job)
    except QueueFull as exc:
        return _error(429, str(exc), "rate_limit_exceeded", **{"Retry-After": str(exc.retry_after_s)})
    except EngineClosed as exc:
        return _error(503, str(exc), "shutting_down")
    except AdapterGone as exc:  # unloaded while this request was being prepared
        return _error(404, str(exc), "model_not_found", "model")
    except NimmerError as exc:  # n beyond this engine's batch
        return _error(400, f"n: {exc}", "invalid_value", "n")
    return None


async def _reply(
    m: LocalModel, req: ChatRequest, job: Job, events: asyncio.Queue, request: Request
) -> Response:
    """The whole completion once every row is done; a client that went away first cancels the
    job (499) so its rows are freed."""
    gather = asyncio.ensure_future(_gather(job, events))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((gather, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        job.cancel()  # a no-op once done; frees the rows of a client that went away
    if not gather.done():  # nobody is left to read the reply
        gather.cancel()
        return Response(status_code=499)
    done, failed = gather.result()
    if failed is not None:
        log.error("generation failed: %s", failed.message)
        return _error(500, f"the server failed to generate a reply: {failed.message}", "server_error")
    return JSONResponse(_completion(m, req, job, done))


def _prepare(
    model: LocalModel, body: Any, limits: ServeLimits, schemas: SchemaCache, sink: Callable[[Any], None]
) -> tuple[ChatRequest, Job]:
    """Check the request and build its engine job (on the preparation thread)."""
    seen: dict[str, list[int]] = {}

    def count(messages: list[dict[str, str]]) -> int:
        seen["ids"] = model.prompt_ids(messages)
        return len(seen["ids"])

    specials = tuple(getattr(model.tokenizer, "all_special_tokens", ()))  # every HF tokenizer has them
    req = check_chat(body, model_ids(model), model.context_tokens, count, limits, schemas, specials)
    job = model.prepare(
        req.messages,
        req.register,
        req.knobs,
        req.schema,
        req.seed,
        sink=sink,
        n=req.n,
        stop=req.stop,
        logprobs=req.logprobs,
        prompt=seen.get("ids"),
        stream=req.stream,
    )
    return req, job


async def _disconnected(request: Request) -> None:
    """Return once the client of a request whose body was read has closed its connection (the
    server answers ``http.disconnect`` then), so that a non-streaming turn frees its rows too."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _gather(job: Job, events: asyncio.Queue) -> tuple[dict[int, Done], Failed | None]:
    done: dict[int, Done] = {}
    while len(done) < job.n:
        event = await events.get()
        if isinstance(event, Failed):
            return done, event
        if isinstance(event, Done):
            done[event.choice] = event
    return done, None


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(model: LocalModel, req: ChatRequest, job: Job, events: asyncio.Queue) -> AsyncIterator[str]:
    """OpenAI's chunks: the role first, content deltas, a finish_reason per choice, the usage
    chunk when asked, ``[DONE]``; an error mid-stream as an ``error`` object. Leaving early
    (the client went away) cancels the job, which frees its rows at the next step."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": req.model_id,
        "system_fingerprint": f"{model.label}:{job.adapter or 'base'}",
    }

    def chunk(choice: int, delta: dict[str, Any], finish: str | None = None, logprobs: Any = None) -> str:
        row = {"index": choice, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        return _sse({**head, "choices": [row]})

    try:
        for choice in range(job.n):
            yield chunk(choice, {"role": "assistant", "content": ""})
        finished, completion = 0, 0
        while finished < job.n:
            event = await events.get()
            if isinstance(event, Failed):
                log.error("generation failed mid-stream: %s", event.message)
                error = RequestError(
                    500, f"the server failed to generate a reply: {event.message}", "server_error"
                )
                yield _sse(error.body())
                break
            if isinstance(event, Delta):
                logprobs = {"content": event.logprobs} if job.logprobs is not None else None
                yield chunk(event.choice, {"content": event.text}, logprobs=logprobs)
            elif isinstance(event, Done):
                finished += 1
                completion += event.completion_tokens
                yield chunk(event.choice, {}, event.finish_reason)
        else:
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(len(job.prompt), completion)})
        yield "data: [DONE]\n\n"
    finally:
        job.cancel()


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _model_list(model: LocalModel, created: int) -> dict[str, Any]:
    data = [
        {
            "id": mid,
            "object": "model",
            "created": created,
            "owned_by": "nimmerworld",
            "root": model.label,
            "parent": None if mid == model.label else model.label,
        }
        for mid in model_ids(model)
    ]
    return {"object": "list", "data": data}


def _completion(model: LocalModel, req: ChatRequest, job: Job, done: dict[int, Done]) -> dict[str, Any]:
    """The chat completion body: one choice per row."""
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": done[i].text},
            "logprobs": {"content": done[i].logprobs} if job.logprobs is not None else None,
            "finish_reason": done[i].finish_reason,
        }
        for i in sorted(done)
    ]
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model_id,
        "system_fingerprint": f"{model.label}:{job.adapter or 'base'}",  # the weights that spoke
        "choices": choices,
        "usage": _usage(len(job.prompt), sum(d.completion_tokens for d in done.values())),
    }


async def _adapter_route(
    model: LocalModel | None, request: Request, limits: ServeLimits, load: bool
) -> JSONResponse:
    """Load or unload a register's LoRA by name; only the signed registry says what fits."""
    from nimmer_train.publish.versions import CompatibilityError

    assert model is not None
    try:
        body = await read_json(request, limits)
    except RequestError as exc:
        return JSONResponse(exc.body(), status_code=exc.status)
    if not isinstance(body, dict) or "lora_path" in body:
        return _error(
            400,
            "adapters load only by register name from the signed version registry; lora_path is not accepted",
            "invalid_request",
            "lora_path",
        )
    name = body.get("lora_name")
    if not isinstance(name, str) or not name:
        return _error(
            400, "lora_name: must be a register name (or <version>:<register>)", "invalid_value", "lora_name"
        )
    register = name.split(":", 1)[1] if name.startswith(f"{model.label}:") else name
    try:
        await asyncio.to_thread(model.load_register if load else model.unload_register, register)
    except CompatibilityError as exc:
        return _error(404, str(exc), "lora_not_found", "lora_name")
    except AdapterBusy as exc:
        return _error(409, str(exc), "lora_busy", "lora_name")
    except NimmerError as exc:  # the registry's files fail their signature or hashes
        return _error(422, f"the LoRA was refused: {exc}", "lora_rejected", "lora_name")
    return JSONResponse({"status": "loaded" if load else "unloaded", "id": f"{model.label}:{register}"})
