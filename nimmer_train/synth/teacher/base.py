"""The teacher interface: what a backend is given, what it returns, how it fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from nimmer_train.errors import NimmerError
from nimmer_train.voice.composition import GenerationRequest


@dataclass
class TeacherReply:
    content: str | None  # the model's text; None when no answer arrived
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0
    error: str | None = None  # "timeout", "http_503", "connection", "malformed_response", ...
    dropped_knobs: tuple[str, ...] = ()  # sampling knobs the backend could not honour


class TeacherFatalError(NimmerError):
    """A failure retrying cannot fix (bad request, bad key, forbidden): the run stops."""


class TeacherUnavailable(NimmerError):
    """Too many requests got no reply at all (connection, timeout, server errors after retries):
    the backend failed, not its replies, so the run stops instead of publishing a thin corpus."""


TRANSPORT_ERRORS = ("timeout", "connection", "malformed_response")  # and every "http_<status>"


def transport_failed(reply: TeacherReply) -> bool:
    """Did ``reply`` fail because the backend could not be reached or answered with an error?"""
    return reply.error is not None and (reply.error in TRANSPORT_ERRORS or reply.error.startswith("http_"))


class Teacher(Protocol):
    backend: str
    model: str
    batch_size: int  # requests per generate() call
    concurrency: int  # generate() calls in flight at once
    # optional ``variant: str``: backend settings that change a reply beyond the request (the
    # reply cache keys on model + variant, so a reply made under other settings is not reused)

    def generate(self, batch: list[GenerationRequest]) -> list[TeacherReply]: ...
