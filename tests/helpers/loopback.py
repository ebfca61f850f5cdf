"""Serve an ASGI app with uvicorn on a free loopback port for the length of a ``with`` block."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn


@contextmanager
def serve_app(app: Any, **config: Any) -> Iterator[str]:
    """Yield the server's base URL (``http://127.0.0.1:PORT``); stop it on exit. ``config``:
    more ``uvicorn.Config`` keywords (default ``log_level="error"``)."""
    sock = socket.socket()  # bound here and handed over: no other process can take the port
    sock.bind(("127.0.0.1", 0))  # between choosing it and the server binding it
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, **{"log_level": "error", **config})
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120  # a hang guard: a loaded machine may start it slowly
    while not server.started:
        assert thread.is_alive(), "the server's thread ended before it started"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()
