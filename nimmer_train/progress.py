"""Progress of long steps in the terminal: a tqdm bar when stderr is a terminal, otherwise (CI
logs, redirected output) one log line at most every ``every_s`` seconds, plus the last step.

Both show the step out of the total, the latest loss, throughput and the time left. The stages
wrap their MLflow metric logger with :func:`with_progress`, so the figures the terminal shows are
the ones the tracking store gets.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import TextIO

from tqdm import tqdm

log = logging.getLogger("nimmer_train.progress")

MetricLogger = Callable[[dict[str, float], int], None]
_shown = [-float("inf")]  # perf_counter of the latest progress line or bar update, any Progress


def _duration(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """``label``: step/total, loss, tokens/s and ETA; call :meth:`update` with absolute steps."""

    def __init__(self, label: str, total: int, every_s: float = 30.0, stream: TextIO | None = None) -> None:
        self.label, self.total, self.every_s = label, max(1, total), every_s
        stream = stream if stream is not None else sys.stderr
        self.bar = (
            tqdm(total=self.total, desc=label, unit="step", file=stream, dynamic_ncols=True)
            if stream.isatty()
            else None
        )
        self.start_step: int | None = None  # the first step seen (a resumed run starts late)
        self.started = time.perf_counter()
        self.last_line = -float("inf")
        self.last_text = ""
        self.figures: dict[str, float] = {}

    def update(self, step: int, metrics: dict[str, float] | None = None) -> None:
        if self.start_step is None:
            self.start_step, self.started = step, time.perf_counter()
        for key in ("train_loss", "val_loss", "tokens_per_s"):
            if metrics and key in metrics:
                self.figures[key] = float(metrics[key])
        _shown[0] = time.perf_counter()
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(self._figures(), refresh=False)
            self.bar.refresh()
            return
        now = time.perf_counter()
        line = f"{self.label}: step {step}/{self.total} ({100 * step // self.total}%){self._line(step)}"
        due = now - self.last_line >= self.every_s or step >= self.total
        if due and line != self.last_text:  # the last step's evaluations repeat it: once is enough
            self.last_line, self.last_text = now, line
            log.info("%s", line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def _figures(self) -> str:
        parts = []
        if "train_loss" in self.figures:
            parts.append(f"loss {self.figures['train_loss']:.3f}")
        if "val_loss" in self.figures:
            parts.append(f"val {self.figures['val_loss']:.3f}")
        if "tokens_per_s" in self.figures:
            parts.append(f"{self.figures['tokens_per_s']:,.0f} tok/s")
        return ", ".join(parts)

    def _line(self, step: int) -> str:
        figures = self._figures()
        done = step - (self.start_step or 0)
        elapsed = time.perf_counter() - self.started
        eta = (
            f"ETA {_duration(elapsed / done * (self.total - step))}" if done > 0 and step < self.total else ""
        )
        tail = ", ".join(p for p in (figures, eta) if p)
        return f", {tail}" if tail else ""


def with_progress(logger: MetricLogger, progress: Progress) -> MetricLogger:
    """``logger`` that also moves ``progress`` to each logged step."""

    def log_and_show(metrics: dict[str, float], step: int) -> None:
        logger(metrics, step)
        progress.update(step, metrics)

    return log_and_show


def _stage_line(label: str, elapsed: float, expected: float | None, after: float | None) -> str:
    if expected is None:
        return f"{label}: {_duration(elapsed)} in (no earlier run to estimate the time left from)"
    left = f"ETA {_duration(expected - elapsed)}" if elapsed < expected else "ETA any moment"
    whole = f"; the run's ETA {_duration(max(expected - elapsed, 0) + after)}" if after else ""
    return f"{label}: {_duration(elapsed)} in, {left} (expected {_duration(expected)}){whole}"


@contextlib.contextmanager
def stage_watch(
    label: str,
    expected_s: float | None,
    after_s: float | None = None,
    quiet_s: float = 10.0,
    every_s: float = 30.0,
) -> Iterator[None]:
    """While a stage runs: once it has run ``quiet_s`` and then every ``every_s``, a progress line
    with the time spent, the ETA from ``expected_s`` (what the stage took when it last did work,
    or an estimate; None: time spent only) and the whole run's from ``after_s`` (what the stages
    after it take), unless a :class:`Progress` of the stage's own (steps, tokens/s, ETA) showed a
    line in that time."""
    started, done = time.perf_counter(), threading.Event()

    def watch() -> None:
        wait = quiet_s
        while not done.wait(wait):
            now, wait = time.perf_counter(), every_s
            if now - max(_shown[0], started) >= min(every_s, now - started):
                log.info("%s", _stage_line(label, now - started, expected_s, after_s))

    thread = threading.Thread(target=watch, name=f"progress {label}", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join(timeout=1.0)
