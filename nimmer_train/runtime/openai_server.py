"""``nimmer serve``: an OpenAI-compatible HTTP server over one verified version (Ring B).

``GET /v1/models`` lists the version and one ``<version>:<register>`` entry per fitting LoRA, as
vLLM lists LoRA modules; ``POST /v1/chat/completions`` applies the adapter the ``model`` field
names, honours temperature, top_p, top_k, min_p, repetition_penalty, max_tokens and seed, and
enforces ``response_format`` (``json_schema`` with the schema, or ``json_object``) while decoding.
Errors use OpenAI's error body. Streaming is not offered (``stream: true`` is refused with 400).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse

from nimmer_train.runtime.local_model import Generation, LocalModel
from nimmer_train.voice.sampling import SamplingKnobs

ANY_JSON = {"type": "object"}


def _error(status: int, message: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def model_ids(model: LocalModel) -> list[str]:
    return [model.label, *(f"{model.label}:{r}" for r in model.registers)]


def create_app(model: LocalModel) -> FastAPI:
    app = FastAPI(title="nimmer serve", version="1")
    created = int(time.time())

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return _model_list(model, created)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_json")
        req = _chat_request(model, body)
        if isinstance(req, JSONResponse):
            return req
        try:
            out = await run_in_threadpool(
                model.generate, req.messages, req.register, req.knobs, req.schema, req.seed
            )
        except ValueError as exc:  # a schema the grammar engine cannot compile
            return _error(400, str(exc), "invalid_response_format", "response_format")
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


@dataclass(frozen=True)
class _ChatRequest:
    """A checked chat completion request."""

    model_id: str
    messages: list[dict[str, Any]]
    register: str | None  # the LoRA the model id names; None: the bare version
    knobs: SamplingKnobs
    schema: dict[str, Any] | None  # the response format to enforce while decoding
    seed: Any


def _chat_request(model: LocalModel, body: Any) -> _ChatRequest | JSONResponse:
    """The request's parts, or OpenAI's error body for the first thing wrong with it."""
    mid = body.get("model")
    if mid not in model_ids(model):
        return _error(404, f"model {mid!r} does not exist; see /v1/models", "model_not_found", "model")
    if body.get("stream"):
        return _error(400, "streaming is not supported by nimmer serve", "unsupported", "stream")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "content" in m for m in messages):
        return _error(400, "messages must be a list of {role, content}", "invalid_messages", "messages")
    register = mid.split(":", 1)[1] if ":" in mid else None
    try:
        knobs = _knobs(body)
    except (TypeError, ValueError) as exc:
        return _error(400, f"bad sampling parameter: {exc}", "invalid_parameter")
    if knobs.temperature <= 0 or not 0 < knobs.top_p <= 1:
        return _error(400, "temperature must be > 0 and top_p in (0, 1]", "invalid_parameter")
    return _ChatRequest(mid, messages, register, knobs, _response_schema(body), body.get("seed"))


def _knobs(body: dict[str, Any]) -> SamplingKnobs:
    """The request's sampling parameters, with OpenAI's defaults (raises on a value of the wrong type)."""
    return SamplingKnobs(
        temperature=float(body.get("temperature", 1.0)),
        top_p=float(body.get("top_p", 1.0)),
        top_k=int(body.get("top_k", 0) or 0),
        repetition_penalty=float(body.get("repetition_penalty", 1.0)),
        min_p=float(body.get("min_p", 0.0) or 0.0),
        max_new_tokens=int(body.get("max_completion_tokens") or body.get("max_tokens") or 256),
    )


def _response_schema(body: dict[str, Any]) -> dict[str, Any] | None:
    fmt = body.get("response_format") or {}
    if fmt.get("type") == "json_schema":
        return (fmt.get("json_schema") or {}).get("schema") or ANY_JSON
    if fmt.get("type") == "json_object":
        return ANY_JSON
    return None


def _completion(model: LocalModel, req: _ChatRequest, out: Generation) -> dict[str, Any]:
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
