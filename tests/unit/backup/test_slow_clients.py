"""Slow clients cannot hold the project's FastAPI services (served as ``backup/serving.py``
serves them, on loopback): connections that never finish their request head are closed by the
head deadline while an honest request is answered, and a body that never finishes gets 408. The
backup host and the A.2 intake are both served through this config."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from nimmer_train.backup.service import local_app
from nimmer_train.backup.serving import server_config
from nimmer_train.federation.intake_service import local_app as intake_app

SLOW = 20  # connections a slow client opens


@contextmanager
def _served(app: object, **deadlines: float) -> Iterator[int]:
    """The app on a free loopback port, as ``serving.serve`` runs it; yields the port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, log_level="error", **deadlines))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _closed_by_server(sock: socket.socket, wait_s: float) -> bool:
    """Whether the server closes ``sock`` within ``wait_s`` (EOF or reset, not our timeout)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("service", ["backup host", "A.2 intake"])
def test_unfinished_request_heads_are_closed_and_honest_requests_answered(
    service: str, tmp_path: Path
) -> None:
    app = local_app(tmp_path / "host") if service == "backup host" else intake_app(tmp_path / "intake", 2)
    with _served(app, header_timeout_s=1.0) as port:
        slow = []
        try:
            for _ in range(SLOW):
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
                sock.sendall(b"POST /uploads HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")  # never finished
                slow.append(sock)
            path = "/backups/some-id" if service == "backup host" else "/uploads"
            honest = httpx.request(
                "GET" if service == "backup host" else "POST", f"http://127.0.0.1:{port}{path}", timeout=5
            )
            assert honest.status_code == 401  # answered (not signed) while the slow ones are open
            started = time.monotonic()
            assert all(_closed_by_server(sock, 10.0) for sock in slow)
            assert time.monotonic() - started < 10.0  # closed by the deadline, bounded
        finally:
            for sock in slow:
                sock.close()


def test_a_body_that_never_finishes_gets_408(tmp_path: Path) -> None:
    with (
        _served(local_app(tmp_path / "host"), body_timeout_s=1.0) as port,
        socket.create_connection(("127.0.0.1", port), timeout=5) as sock,
    ):
        sock.sendall(
            b"POST /accounts HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b'Content-Length: 1000\r\n\r\n{"public_key": '
        )
        sock.settimeout(10.0)
        answer = sock.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"within 1 s" in answer
