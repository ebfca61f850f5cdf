"""What ``nimmer serve`` accepts, checked before any engine work and independent of the engine:
OpenAI-style 400s naming the field for malformed requests, and the resource limits.

Limits (:class:`ServeLimits`): the body is read up to ``max_body_bytes`` (413 past it); a
``response_format`` schema is at most ``max_schema_bytes`` of JSON and ``max_schema_depth`` deep,
must be a valid JSON Schema whose top-level properties are objects, and must compile to a grammar;
only schemas that compiled enter the bounded :class:`SchemaCache`. ``max_tokens`` (or
``max_completion_tokens``) is clamped to the context left after the prompt, and a prompt that
fills the context is a 400 naming both numbers. Before that count, a prompt of more characters
than ``max_chars_per_token`` times the context is a 400 untokenized: tokenizing runs on the one
preparation thread, so a 1 MiB prompt would hold every request behind it for about half a second.
An optional bearer token guards every route.
"""

from __future__ import annotations

import hmac
import json
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from nimmer_train.voice.sampling import SamplingKnobs

ANY_JSON = {"type": "object"}
ROLES = ("system", "developer", "user", "assistant")
MAX_SEED = 2**63 - 1
DEFAULT_MAX_TOKENS = 256  # when the request names none (then clamped like any other)


@dataclass(frozen=True)
class ServeLimits:
    max_body_bytes: int = 2**20  # 1 MiB: a turn's prompt is a few KB
    max_schema_bytes: int = 16 * 2**10  # the NPC turn schema is ~300 bytes
    max_schema_depth: int = 16
    max_messages: int = 256
    schema_cache_size: int = 128  # compiled schemas remembered (least recently used dropped)
    max_n: int = 8  # choices per request (rows of one batch)
    max_stop: int = 4  # stop strings per request, as OpenAI
    max_stop_chars: int = 64
    # characters per token of context a prompt may have before it is tokenized (text runs 3-5;
    # raise it for prompts of long whitespace or symbol runs, which tokenize more densely)
    max_chars_per_token: int = 8


class RequestError(Exception):
    """A request refused with OpenAI's error body: ``status``, ``code`` and the field (``param``)."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param

    def body(self) -> dict[str, Any]:
        kind = {401: "authentication_error"}.get(self.status, "invalid_request_error")
        kind = "server_error" if self.status >= 500 else kind
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}


def _bad(param: str, message: str, code: str = "invalid_value") -> RequestError:
    return RequestError(400, f"{param}: {message}", code, param)


def check_bearer(authorization: str | None, api_key: str | None) -> None:
    """401 unless ``api_key`` is unset or the header is ``Bearer <api_key>`` (constant-time)."""
    if api_key is None:
        return
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError(401, "missing or wrong API key (Authorization: Bearer ...)", "invalid_api_key")


async def read_json(request: Request, limits: ServeLimits) -> Any:
    """The body as JSON, read at most ``max_body_bytes`` (413 past it, before reading it all)."""
    too_big = RequestError(
        413, f"the body is over the server's limit of {limits.max_body_bytes} bytes", "body_too_large"
    )
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limits.max_body_bytes):
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limits.max_body_bytes:
            raise too_big
        chunks.append(chunk)

    def no_constants(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        body = json.loads(b"".join(chunks), parse_constant=no_constants)
    except (ValueError, RecursionError) as exc:
        raise RequestError(400, f"the body is not valid JSON ({exc})", "invalid_json") from exc
    try:  # json admits an escaped lone surrogate ("\ud800"); tokenizers and llguidance raise on it
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise RequestError(
            400,
            "the body is not valid JSON text: it holds a lone UTF-16 surrogate escape (\\ud800-\\udfff "
            "without its pair), which is not a Unicode character",
            "invalid_json",
        ) from exc
    return body


def _number(body: dict[str, Any], key: str, default: float, low: float, high: float, low_open: bool) -> float:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _bad(key, f"must be a finite number, not {value!r}")
    if value < low or (low_open and value == low) or value > high:
        raise _bad(key, f"must be in {'(' if low_open else '['}{low}, {high}], not {value!r}")
    return float(value)


def _integer(body: dict[str, Any], key: str, low: int, high: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _bad(key, f"must be an integer in [{low}, {high}], not {value!r}")
    return value


def check_messages(
    body: dict[str, Any], limits: ServeLimits, special_tokens: tuple[str, ...] = ()
) -> list[dict[str, str]]:
    """The messages as ``{role, content}``; a content holding one of the tokenizer's
    ``special_tokens`` is refused: the tokenizer would read ``<|im_end|>`` in a player's line as
    the real end of the turn, letting the text forge a system or assistant turn."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not 0 < len(messages) <= limits.max_messages:
        raise _bad("messages", f"must be a list of 1-{limits.max_messages} {{role, content}} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise _bad(f"messages[{i}]", "must be an object with role and content")
        if message.get("role") not in ROLES:
            raise _bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}")
        if not isinstance(message.get("content"), str):
            raise _bad(f"messages[{i}].content", "must be a string (content parts are not supported)")
        forged = next((t for t in special_tokens if t in message["content"]), None)
        if forged is not None:
            raise _bad(
                f"messages[{i}].content",
                f"holds the special token {forged!r}, which would end or open a turn of the chat "
                "template; remove it from the text",
            )
        out.append({"role": message["role"], "content": message["content"]})
    return out


def check_knobs(body: dict[str, Any]) -> SamplingKnobs:
    """The sampling parameters with OpenAI's defaults; ``max_new_tokens`` is set later (clamped)."""
    return SamplingKnobs(
        temperature=_number(body, "temperature", 1.0, 0.0, 5.0, low_open=False),  # 0: greedy
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, low_open=True),
        top_k=_integer(body, "top_k", 0, 2**31 - 1) or 0,
        repetition_penalty=_number(body, "repetition_penalty", 1.0, 0.0, 10.0, low_open=True),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0, low_open=False),
        max_new_tokens=1,
        no_repeat_ngram_size=_integer(body, "no_repeat_ngram_size", 0, 64) or 0,  # HF's name; an extension
        max_sentence_repeats=_integer(body, "max_sentence_repeats", 0, 64) or 0,  # an extension too
    )


def requested_tokens(body: dict[str, Any]) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        value = _integer(body, key, 1, 2**31 - 1)
        if value is not None:
            return value
    return None


def check_prompt_chars(messages: list[dict[str, str]], context_tokens: int, limits: ServeLimits) -> None:
    """A 400 for a prompt too long to fit the context at ``max_chars_per_token``, before it is
    tokenized (see the module docstring)."""
    chars = sum(len(m["content"]) for m in messages)
    limit = limits.max_chars_per_token * context_tokens
    if chars > limit:
        raise RequestError(
            400,
            f"messages: the prompt is {chars} characters, over this server's limit of {limit} "
            f"({limits.max_chars_per_token} characters per token of the model's context of "
            f"{context_tokens} tokens); shorten the messages",
            "context_length_exceeded",
            "messages",
        )


def clamp_tokens(requested: int | None, prompt_tokens: int, context_tokens: int) -> int:
    """``requested`` (None: :data:`DEFAULT_MAX_TOKENS`) limited to the context left after the
    prompt; a prompt that leaves no room is a 400 naming both numbers."""
    room = context_tokens - prompt_tokens
    if room < 1:
        raise RequestError(
            400,
            f"messages: the prompt is {prompt_tokens} tokens; the model's context is {context_tokens} "
            "tokens, which leaves no room for a reply; shorten the messages",
            "context_length_exceeded",
            "messages",
        )
    return min(DEFAULT_MAX_TOKENS if requested is None else requested, room)


def _depth(node: Any) -> int:
    depth, level = 0, [node]
    while level:
        depth += 1
        level = [
            child
            for item in level
            for child in (item.values() if isinstance(item, dict) else item if isinstance(item, list) else ())
            if isinstance(child, dict | list)
        ]
    return depth


def response_schema(body: dict[str, Any], limits: ServeLimits) -> dict[str, Any] | None:
    """The schema to enforce while decoding (None: free text), checked for shape and size."""
    fmt = body.get("response_format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise _bad("response_format", "must be an object with type text, json_object or json_schema")
    if fmt["type"] == "text":
        return None
    if fmt["type"] == "json_object":
        return ANY_JSON
    spec = fmt.get("json_schema")
    if not isinstance(spec, dict):
        raise _bad("response_format.json_schema", "must be an object with name and schema")
    schema = spec.get("schema", ANY_JSON)
    param = "response_format.json_schema.schema"
    if not isinstance(schema, dict):
        raise _bad(param, "must be a JSON Schema object")
    size = len(json.dumps(schema))
    if size > limits.max_schema_bytes:
        raise _bad(
            param, f"is {size} bytes of JSON; the limit is {limits.max_schema_bytes}", "schema_too_large"
        )
    if _depth(schema) > limits.max_schema_depth:
        raise _bad(param, f"nests deeper than {limits.max_schema_depth} levels", "schema_too_large")
    from jsonschema import SchemaError
    from jsonschema.validators import validator_for

    try:
        validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise _bad(
            param + (f".{where}" if where else ""), f"is not a valid JSON Schema: {exc.message}"
        ) from exc
    props = schema.get("properties", {})
    bad = sorted(k for k, v in props.items() if not isinstance(v, dict)) if isinstance(props, dict) else []
    if bad:
        raise _bad(f"{param}.properties.{bad[0]}", "each property must be a schema object")
    return schema


def compile_grammar(schema: dict[str, Any]) -> str | None:
    """None if llguidance compiles ``schema`` to a grammar, else its error (no tokenizer needed)."""
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(schema)) or None


class SchemaCache:
    """Schemas known to compile, by canonical JSON, least recently used dropped past ``size``;
    a schema that fails to compile is never remembered (and never reaches the engine)."""

    def __init__(self, size: int, compile_: Callable[[dict[str, Any]], str | None] = compile_grammar) -> None:
        self.size, self.compile = size, compile_
        self.known: OrderedDict[str, None] = OrderedDict()
        self.lock = threading.Lock()

    def check(self, schema: dict[str, Any]) -> None:
        key = json.dumps(schema, sort_keys=True)
        with self.lock:
            if key in self.known:
                self.known.move_to_end(key)
                return
        try:
            error = self.compile(schema)
        except (ValueError, TypeError, OverflowError) as exc:  # e.g. an integer past 64 bits
            error = str(exc)
        if error:
            raise RequestError(
                400,
                f"response_format.json_schema.schema cannot be compiled to a grammar: {error}",
                "invalid_response_format",
                "response_format",
            )
        with self.lock:
            self.known[key] = None
            while len(self.known) > self.size:
                self.known.popitem(last=False)


def check_stream(body: dict[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage) from ``stream`` and ``stream_options``."""
    stream = body.get("stream")
    if stream not in (None, True, False):
        raise _bad("stream", f"must be true or false, not {stream!r}")
    options = body.get("stream_options")
    if options is None:
        return bool(stream), False
    if not stream:
        raise _bad("stream_options", "is only allowed with stream: true")
    if not isinstance(options, dict) or options.get("include_usage") not in (None, True, False):
        raise _bad("stream_options", "must be an object whose include_usage is true or false")
    return True, bool(options.get("include_usage"))


def check_stop(body: dict[str, Any], limits: ServeLimits) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stops, list)
        or len(stops) > limits.max_stop
        or not all(isinstance(s, str) and 0 < len(s) <= limits.max_stop_chars for s in stops)
    ):
        raise _bad(
            "stop",
            f"must be a string or a list of at most {limits.max_stop} non-empty strings of at most "
            f"{limits.max_stop_chars} characters",
        )
    return tuple(stops)


def check_logprobs(body: dict[str, Any]) -> int | None:
    """None without ``logprobs``; else how many ``top_logprobs`` per token (0-20)."""
    wanted = body.get("logprobs")
    if wanted not in (None, True, False):
        raise _bad("logprobs", f"must be true or false, not {wanted!r}")
    top = _integer(body, "top_logprobs", 0, 20)
    if top is not None and not wanted:
        raise _bad("top_logprobs", "needs logprobs: true")
    return (top or 0) if wanted else None


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat completion request, within the limits."""

    model_id: str
    messages: list[dict[str, str]]
    register: str | None  # the LoRA the model id names; None: the bare version
    knobs: SamplingKnobs  # max_new_tokens clamped to the context left after the prompt
    schema: dict[str, Any] | None  # the response format to enforce while decoding
    seed: int | None
    prompt_tokens: int
    n: int = 1
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; else top_logprobs per token
    stream: bool = False
    include_usage: bool = False


def check_chat(
    body: Any,
    model_ids: list[str],
    context_tokens: int,
    count_prompt: Callable[[list[dict[str, str]]], int],
    limits: ServeLimits,
    schemas: SchemaCache,
    special_tokens: tuple[str, ...] = (),
) -> ChatRequest:
    """The request's parts, or :class:`RequestError` for the first thing wrong with it
    (``special_tokens``: the tokenizer's, never allowed inside a message)."""
    if not isinstance(body, dict):
        raise RequestError(
            400, f"the body must be a JSON object, not {type(body).__name__}", "invalid_request"
        )
    mid = body.get("model")
    if not isinstance(mid, str) or mid not in model_ids:
        raise RequestError(404, f"model {mid!r} does not exist; see /v1/models", "model_not_found", "model")
    stream, include_usage = check_stream(body)
    messages = check_messages(body, limits, special_tokens)
    check_prompt_chars(messages, context_tokens, limits)
    knobs = check_knobs(body)
    seed = _integer(body, "seed", 0, MAX_SEED)
    requested = requested_tokens(body)
    n = _integer(body, "n", 1, limits.max_n) or 1
    stop = check_stop(body, limits)
    logprobs = check_logprobs(body)
    schema = response_schema(body, limits)
    if schema is not None:
        schemas.check(schema)
    prompt_tokens = count_prompt(messages)
    knobs = SamplingKnobs(
        **{**knobs.as_dict(), "max_new_tokens": clamp_tokens(requested, prompt_tokens, context_tokens)}
    )
    register = mid.split(":", 1)[1] if ":" in mid else None
    return ChatRequest(
        mid, messages, register, knobs, schema, seed, prompt_tokens, n, stop, logprobs, stream, include_usage
    )
