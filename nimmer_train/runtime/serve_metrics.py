"""What ``GET /metrics`` says, in Prometheus' text format (version 0.0.4), kept by the engine:
requests running and waiting, the batch size per decode step, time to first token, end-to-end
latency, and requests and tokens in and out per register. No client library: a few counters and
histograms written as text."""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 64)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        self.total += value
        self.n += 1
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1

    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def lines(self, name: str, labels: str = "") -> list[str]:
        sep = "," if labels else ""
        out = [
            f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {count}'
            for bound, count in zip(self.buckets, self.counts, strict=True)
        ]
        braces = f"{{{labels}}}" if labels else ""
        out += [f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.n}', f"{name}_sum{braces} {self.total:.6f}"]
        return [*out, f"{name}_count{braces} {self.n}"]


class ServeMetrics:
    """Updated from the decode thread, read by ``/metrics``; one lock around both."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = 0
        self.largest_batch = 0
        self.waiting = 0
        self.batch_size = Histogram(BATCH_BUCKETS)
        self.e2e = Histogram(LATENCY_BUCKETS)  # every register (the Retry-After estimate)
        self.ttft_by: dict[str, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))
        self.e2e_by: dict[str, Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))
        self.prompt_tokens: dict[str, int] = defaultdict(int)
        self.completion_tokens: dict[str, int] = defaultdict(int)
        self.rows: dict[tuple[str, str], int] = defaultdict(int)  # (register, finish_reason)

    def batch(self, size: int) -> None:
        with self.lock:
            self.running = size
            self.largest_batch = max(self.largest_batch, size)
            self.batch_size.observe(size)

    def started(self, register: str, prompt_tokens: int, ttft_s: float) -> None:
        with self.lock:
            self.prompt_tokens[register] += prompt_tokens
            self.ttft_by[register].observe(ttft_s)

    def finished(self, register: str, completion_tokens: int, finish: str, seconds: float) -> None:
        with self.lock:
            self.completion_tokens[register] += completion_tokens
            self.rows[(register, finish)] += 1
            self.e2e.observe(seconds)
            self.e2e_by[register].observe(seconds)

    def cancelled(self, register: str) -> None:
        with self.lock:
            self.rows[(register, "cancelled")] += 1

    def render(self, running: int, waiting: int) -> str:
        p = "nimmer_serve"
        with self.lock:
            lines = [
                f"# HELP {p}_requests_running Rows in the running batch.",
                f"# TYPE {p}_requests_running gauge",
                f"{p}_requests_running {running}",
                f"# HELP {p}_requests_waiting Requests queued for the batch.",
                f"# TYPE {p}_requests_waiting gauge",
                f"{p}_requests_waiting {waiting}",
                f"# HELP {p}_batch_size Rows per decode step.",
                f"# TYPE {p}_batch_size histogram",
                *self.batch_size.lines(f"{p}_batch_size"),
                f"# HELP {p}_time_to_first_token_seconds From arrival to the first token, per register.",
                f"# TYPE {p}_time_to_first_token_seconds histogram",
                *_by(self.ttft_by, f"{p}_time_to_first_token_seconds"),
                f"# HELP {p}_e2e_latency_seconds From arrival to a row's last token, per register.",
                f"# TYPE {p}_e2e_latency_seconds histogram",
                *_by(self.e2e_by, f"{p}_e2e_latency_seconds"),
                f"# HELP {p}_prompt_tokens_total Prompt tokens prefilled, per register.",
                f"# TYPE {p}_prompt_tokens_total counter",
                *(
                    f'{p}_prompt_tokens_total{{register="{r}"}} {v}'
                    for r, v in sorted(self.prompt_tokens.items())
                ),
                f"# HELP {p}_completion_tokens_total Tokens generated, per register.",
                f"# TYPE {p}_completion_tokens_total counter",
                *(
                    f'{p}_completion_tokens_total{{register="{r}"}} {v}'
                    for r, v in sorted(self.completion_tokens.items())
                ),
                f"# HELP {p}_rows_total Rows ended, per register and finish reason.",
                f"# TYPE {p}_rows_total counter",
                *(
                    f'{p}_rows_total{{register="{r}",finish_reason="{f}"}} {v}'
                    for (r, f), v in sorted(self.rows.items())
                ),
            ]
        return "\n".join(lines) + "\n"


def _by(histograms: dict[str, Histogram], name: str) -> list[str]:
    return [line for r, h in sorted(histograms.items()) for line in h.lines(name, f'register="{r}"')]
