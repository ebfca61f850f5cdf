"""How the project's small FastAPI services (the backup host, the A.2 intake) are served: uvicorn
with deadlines a slow client cannot stretch. uvicorn has no deadline on reading a request's head
(a client that sends half a header line and waits holds its connection, and a descriptor, for
good) nor on its body, so both are added here: the connection is closed when a request's head is
not complete ``header_timeout_s`` after the connection opened or the last response went out, and
a body not read in full ``body_timeout_s`` after its request began gets 408. ``limit_concurrency``
answers 503 past that many open connections, ``timeout_keep_alive`` closes idle ones. Behind a
reverse proxy, set its own limits too (docs/federation-deployment.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

import uvicorn
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0  # to send a request's head (its line and headers)
BODY_TIMEOUT_S = 60.0  # to send a whole body (8 MiB, the backup host's cap, at about 140 kB/s)
LIMIT_CONCURRENCY = 256  # open connections and requests; more get 503
TIMEOUT_KEEP_ALIVE_S = 5  # an idle kept-alive connection is closed after this


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing a connection whose request head is late."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()

    def _arm(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._head_due, self.cycle)

    def _head_due(self, cycle: Any) -> None:
        """Close the connection if no request head came since the timer was set (the cycle is
        the same one, and it is finished or there was none)."""
        waiting = self.cycle is cycle and (cycle is None or cycle.response_complete)
        if waiting and not self.transport.is_closing():
            self.transport.close()


class BodyDeadline:
    """ASGI middleware: a request body must arrive in full ``timeout_s`` after its request
    began, or the route reading it gets 408 (uvicorn then closes the connection)."""

    def __init__(self, app: ASGIApp, timeout_s: float = BODY_TIMEOUT_S) -> None:
        self.app, self.timeout_s = app, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        deadline, done = loop.time() + self.timeout_s, False

        async def timed_receive() -> Message:
            nonlocal done
            if done:  # the body is in: waiting for a disconnect has no deadline
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError as exc:
                raise HTTPException(
                    408, f"the request body did not arrive within {self.timeout_s:.0f} s; send it again"
                ) from exc
            done = message["type"] != "http.request" or not message.get("more_body", False)
            return message

        await self.app(scope, timed_receive, send)


def server_config(
    app: ASGIApp,
    host: str,
    port: int,
    header_timeout_s: float = HEADER_TIMEOUT_S,
    body_timeout_s: float = BODY_TIMEOUT_S,
    **config: Any,
) -> uvicorn.Config:
    """A uvicorn config for ``app`` with the deadlines and caps above; ``config``: more
    ``uvicorn.Config`` keywords (logging), which may also override the caps."""
    protocol = type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), {"header_timeout_s": header_timeout_s})
    caps = {"limit_concurrency": LIMIT_CONCURRENCY, "timeout_keep_alive": TIMEOUT_KEEP_ALIVE_S}
    return uvicorn.Config(
        BodyDeadline(app, body_timeout_s), host=host, port=port, http=protocol, **{**caps, **config}
    )


def serve(app: ASGIApp, host: str, port: int, **config: Any) -> None:
    """Run ``app`` on ``host:port`` until stopped (Ctrl-C / SIGTERM), as :func:`server_config`."""
    uvicorn.Server(server_config(app, host, port, **config)).run()
