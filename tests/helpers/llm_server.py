"""A loopback stand-in for OpenAI-compatible and Anthropic chat servers (third parties we cannot
run here). Tests script its behaviour per request: 429 with Retry-After, 5xx, slow answers,
malformed bodies, 4xx refusals; it counts every request it receives, by request content.

With ``models`` it also answers ``GET /v1/models`` as a vLLM farm started with ``--enable-lora
--lora-modules <version>:<register>=PATH ...`` does (the base model id, then one id per LoRA
module whose ``parent`` is the base), and refuses a chat for a model it does not list with
vLLM's 404: the stand-in for Ring B's swap test."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Answer = Callable[[dict[str, Any]], Any]  # the reply text, or a whole OpenAI message dict


class LLMServer:
    def __init__(
        self, answer: Answer | None = None, latency_s: float = 0.0, models: list[str] | None = None
    ) -> None:
        self.models = models
        self.answer = answer or (lambda body: json.dumps({"utterance": "We have heard you, citizen."}))
        self.latency_s = latency_s
        self.script: list[tuple[int, dict[str, str], str] | str] = []  # consumed one per request
        self.counts: Counter[str] = Counter()  # by system message content
        self.requests: list[dict[str, Any]] = []
        self.headers: list[dict[str, str]] = []
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # one segment per reply: no delayed-ACK stalls

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server naming
                if server.models is None or not self.path.endswith("/v1/models"):
                    return self._send(404, b'{"error": {"message": "not found"}}')
                base = server.models[0]
                data = [
                    {
                        "id": m,
                        "object": "model",
                        "owned_by": "vllm",
                        "root": base,
                        "parent": None if m == base else base,
                    }
                    for m in server.models
                ]
                self._send(200, json.dumps({"object": "list", "data": data}).encode())

            def do_POST(self) -> None:  # noqa: N802 - http.server naming
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if server.models is not None and body.get("model") not in server.models:
                    error = {
                        "message": f"The model `{body.get('model')}` does not exist.",
                        "type": "NotFoundError",
                    }
                    return self._send(404, json.dumps({"error": error, "code": 404}).encode())
                with server.lock:
                    server.requests.append(body)
                    server.headers.append(dict(self.headers))
                    system = body.get("system") or body["messages"][0]["content"]
                    server.counts[system] += 1
                    step = server.script.pop(0) if server.script else None
                if step == "slow":
                    time.sleep(3.0)
                elif server.latency_s:
                    time.sleep(server.latency_s)
                if isinstance(step, tuple):
                    status, headers, text = step
                    return self._send(status, text.encode(), headers)
                if step == "malformed":
                    return self._send(200, b"{not json at all")
                content = server.answer(body)
                if self.path.endswith("/v1/messages"):  # Anthropic Messages API
                    block: dict[str, Any] = {"type": "text", "text": content}
                    if body.get("tools"):  # a forced tool call answers with the tool's input
                        with suppress(ValueError):
                            block = {
                                "type": "tool_use",
                                "id": "toolu_1",
                                "name": body["tools"][0]["name"],
                                "input": json.loads(content),
                            }
                    data = {
                        "content": [block],
                        "usage": {"input_tokens": 40, "output_tokens": 12},
                    }
                else:  # an answer may be a whole message (tool_calls for the Ring C tool loop)
                    message = (
                        content if isinstance(content, dict) else {"role": "assistant", "content": content}
                    )
                    data = {
                        "choices": [{"message": message}],
                        "usage": {"prompt_tokens": 40, "completion_tokens": 12},
                    }
                self._send(200, json.dumps(data).encode())

            def _send(self, status: int, payload: bytes, headers: dict[str, str] | None = None) -> None:
                try:
                    self.send_response(status)
                    for key, value in (headers or {}).items():
                        self.send_header(key, value)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up (timeout test)

        return Handler

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextmanager
def serve(
    answer: Answer | None = None, latency_s: float = 0.0, models: list[str] | None = None
) -> Iterator[LLMServer]:
    server = LLMServer(answer, latency_s, models)
    thread = threading.Thread(target=server.httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.httpd.shutdown()
        server.httpd.server_close()
