"""``nimmer serve``: an OpenAI-compatible HTTP server over one verified version (Ring B).

``GET /v1/models`` lists the version and one ``<version>:<register>`` entry per fitting LoRA, as
vLLM lists LoRA modules; ``POST /v1/chat/completions`` applies the adapter the ``model`` field
names, honours temperature, top_p, top_k, min_p, repetition_penalty, max_tokens and seed, and
enforces ``response_format`` (``json_schema`` with the schema, or ``json_object``) while decoding.
Errors use OpenAI's error body. Streaming is not offered (``stream: true`` is refused with 400).

Requests are checked by :mod:`nimmer_train.runtime.request_limits` before the engine sees them:
body and schema size caps, ``max_tokens`` clamped to the context left after the prompt, only
schemas that compile cached, 400s naming the field, and optional bearer-token authentication
(``nimmer serve --api-key-env VAR``, required to bind beyond loopback).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from nimmer_train.runtime.local_model import Generation, LocalModel
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


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(RequestError(status, message, code, param).body(), status_code=status)


def model_ids(model: LocalModel) -> list[str]:
    return [model.label, *(f"{model.label}:{r}" for r in model.registers)]


def prompt_tokens(model: LocalModel, messages: list[dict[str, str]]) -> int:
    """The prompt's length in the model's tokens, as generation will see it."""
    ids = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    return len(ids)


def create_app(model: LocalModel, api_key: str | None = None, limits: ServeLimits | None = None) -> FastAPI:
    """The server over ``model``; with ``api_key`` every route needs ``Authorization: Bearer``."""
    app = FastAPI(title="nimmer serve", version="1")
    created = int(time.time())
    limits = limits or ServeLimits()
    schemas = SchemaCache(limits.schema_cache_size)
    app.state.schemas = schemas

    @app.middleware("http")
    async def authenticate(request: Request, call_next: Any) -> Any:
        try:
            check_bearer(request.headers.get("authorization"), api_key)
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return _model_list(model, created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        try:
            body = await read_json(request, limits)
            req = await run_in_threadpool(
                check_chat,
                body,
                model_ids(model),
                model.context_tokens,
                lambda messages: prompt_tokens(model, messages),
                limits,
                schemas,
            )
        except RequestError as exc:
            return JSONResponse(exc.body(), status_code=exc.status)
        try:
            out = await run_in_threadpool(
                model.generate, req.messages, req.register, req.knobs, req.schema, req.seed
            )
        except ValueError as exc:  # a schema the engine's grammar cannot use after all
            return _error(400, str(exc), "invalid_response_format", "response_format")
        except Exception:  # never a bare 500 page: OpenAI's error body, the trace in the log
            log.exception("generation failed")
            return _error(500, "the server failed to generate a reply", "server_error")
        return JSONResponse(_completion(model, req, out))

    return app


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


def _completion(model: LocalModel, req: ChatRequest, out: Generation) -> dict[str, Any]:
    """The chat completion body for one generation."""
    finish = "length" if out.completion_tokens >= req.knobs.max_new_tokens else "stop"
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": req.model_id,
        "system_fingerprint": f"{model.label}:{out.adapter or 'base'}",  # the weights that spoke
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": out.text},
                "finish_reason": finish,
            }
        ],
        "usage": {
            "prompt_tokens": out.prompt_tokens,
            "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
        },
    }
