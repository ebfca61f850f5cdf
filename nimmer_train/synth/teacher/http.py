"""POST with retries: exponential backoff with jitter on 429, 5xx, timeouts and connection
errors; Retry-After honoured; 400/401/403 fail at once with a clear message. Inside
:func:`deadline` (a game turn: runtime/rings.py) no wait runs past it: a Retry-After or backoff
that would is not taken and the call returns its error reply; a malformed Retry-After is ignored
(backoff instead), never raised."""

from __future__ import annotations

import contextvars
import email.utils
import logging
import math
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from nimmer_train.config import TeacherConfig
from nimmer_train.synth.teacher.base import TeacherFatalError, TeacherReply

log = logging.getLogger(__name__)

RETRYABLE = {408, 409, 425, 429, 500, 502, 503, 504, 529}
FATAL_HINT = {
    400: "the request was refused as malformed; check model name and sampling options",
    401: "unauthorised; check the API key in the environment variable teacher.api_key_env names",
    403: "forbidden; the key has no access to this model",
}


# time.monotonic() past which no call in this context waits: set by :func:`deadline`
_DEADLINE: contextvars.ContextVar[float | None] = contextvars.ContextVar("teacher_deadline", default=None)


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Within the block :func:`post_with_retries` never waits past ``seconds`` from now (nor past
    an enclosing deadline): request timeouts shrink to the time left, and a wait that would end
    later gives up with the error reply at once."""
    outer = _DEADLINE.get()
    until = time.monotonic() + seconds
    token = _DEADLINE.set(until if outer is None else min(outer, until))
    try:
        yield
    finally:
        _DEADLINE.reset(token)


def retry_after_s(response: httpx.Response) -> float | None:
    """Seconds the server asked us to wait (delta-seconds or an HTTP date), if it said; None for
    a value that is neither (or not finite): the caller backs off as it would without one."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value).timestamp() - time.time()
        except (TypeError, ValueError, OverflowError):
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


def backoff_s(attempt: int, cfg: TeacherConfig) -> float:
    """Full-jitter exponential backoff: uniform in [d/2, d], d = min(max, base * 2^attempt)."""
    delay = min(cfg.backoff_max_s, cfg.backoff_base_s * 2**attempt)
    return delay * (0.5 + random.random() / 2)


def post_with_retries(
    client: httpx.Client,
    url: str,
    body: dict[str, Any],
    headers: dict[str, str],
    cfg: TeacherConfig,
    parse: Callable[[dict[str, Any]], TeacherReply],
    sleep: Callable[[float], None] = time.sleep,
) -> TeacherReply:
    """POST ``body`` and parse the JSON answer; a reply with ``error`` set once retries run out."""
    started, until = time.perf_counter(), _DEADLINE.get()
    error = "unknown"
    for attempt in range(cfg.max_retries + 1):
        wait: float | None = None
        timeout = cfg.timeout_s if until is None else max(0.01, min(cfg.timeout_s, until - time.monotonic()))
        try:
            response = client.post(url, json=body, headers=headers, timeout=timeout)
        except httpx.TimeoutException:
            error = "timeout"
        except httpx.TransportError:
            error = "connection"
        else:
            if response.status_code in FATAL_HINT or (
                400 <= response.status_code < 500 and response.status_code not in RETRYABLE
            ):
                hint = FATAL_HINT.get(response.status_code, "the server refused the request")
                raise TeacherFatalError(
                    f"{cfg.backend} at {url} answered {response.status_code}: {hint}. "
                    f"Server said: {response.text[:300]}"
                )
            if response.status_code in RETRYABLE:
                error = f"http_{response.status_code}"
                wait = retry_after_s(response)
            else:
                try:
                    reply = parse(response.json())
                    reply.latency_s = time.perf_counter() - started
                    return reply
                except (ValueError, KeyError, IndexError, TypeError):
                    error = "malformed_response"
        if attempt < cfg.max_retries:
            delay = wait if wait is not None else backoff_s(attempt, cfg)
            if until is not None and time.monotonic() + delay > until:
                log.warning(
                    "teacher %s: %s; waiting %.1f s%s would pass the deadline; giving up",
                    url,
                    error,
                    delay,
                    " as the server asked (Retry-After)" if wait is not None else "",
                )
                error = f"{error}_past_deadline"
                break
            log.warning(
                "teacher %s: %s (attempt %d of %d); retrying in %.1f s%s",
                url,
                error,
                attempt + 1,
                cfg.max_retries + 1,
                delay,
                " as the server asked (Retry-After)" if wait is not None else "",
            )
            sleep(delay)
        else:
            log.warning(
                "teacher %s: %s after %d attempts; giving up on this request", url, error, attempt + 1
            )
    return TeacherReply(None, latency_s=time.perf_counter() - started, error=error)
