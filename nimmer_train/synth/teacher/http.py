"""POST with retries: exponential backoff with jitter on 429, 5xx, timeouts and connection
errors; Retry-After honoured; 400/401/403 fail at once with a clear message."""

from __future__ import annotations

import email.utils
import logging
import random
import time
from collections.abc import Callable
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


def retry_after_s(response: httpx.Response) -> float | None:
    """Seconds the server asked us to wait (delta-seconds or an HTTP date), if it said."""
    value = response.headers.get("retry-after")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time()) if when else None


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
    started = time.perf_counter()
    error = "unknown"
    for attempt in range(cfg.max_retries + 1):
        wait: float | None = None
        try:
            response = client.post(url, json=body, headers=headers, timeout=cfg.timeout_s)
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
