"""Progress of long steps: periodic lines in logs, a bar on a terminal, the figures logged."""

from __future__ import annotations

import io
import logging
import re
import time

from nimmer_train.progress import Progress, stage_watch, with_progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_logs_get_a_line_per_interval_with_loss_throughput_and_eta(caplog) -> None:
    logged: list[tuple[dict[str, float], int]] = []
    progress = Progress("build_base", 100, every_s=3600.0, stream=io.StringIO())
    logger = with_progress(lambda metrics, step: logged.append((metrics, step)), progress)
    with caplog.at_level(logging.INFO, logger="nimmer_train.progress"):
        logger({"train_loss": 5.25, "tokens_per_s": 1234.0}, 10)
        logger({"train_loss": 4.5}, 20)  # within the interval: no line
        logger({"train_loss": 4.0, "val_loss": 4.1}, 100)  # the last step always gets one
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "build_base: step 10/100 (10%), loss 5.250, 1,234 tok/s"
    assert lines[1] == "build_base: step 100/100 (100%), loss 4.000, val 4.100, 1,234 tok/s"
    assert [step for _, step in logged] == [10, 20, 100]  # the tracking logger still gets every one


def test_eta_comes_from_the_steps_made_in_this_run(caplog) -> None:
    progress = Progress("train_loras r", 100, every_s=0.0, stream=io.StringIO())
    with caplog.at_level(logging.INFO, logger="nimmer_train.progress"):
        progress.update(50, {"train_loss": 1.0})  # a resumed run starts at step 50
        progress.update(60, {"train_loss": 0.9})
    assert "ETA" not in caplog.records[0].getMessage() and "ETA" in caplog.records[1].getMessage()


def test_a_terminal_gets_a_bar() -> None:
    terminal = Terminal()
    progress = Progress("build_base", 40, stream=terminal)
    progress.update(20, {"train_loss": 3.5})
    progress.close()
    assert "build_base" in terminal.getvalue() and "20/40" in terminal.getvalue()
    assert "loss 3.500" in terminal.getvalue()


def test_a_stage_without_steps_gets_lines_with_its_eta_and_the_runs(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="nimmer_train.progress"):
        with stage_watch("run_all federate (5/7)", expected_s=120.0, after_s=300.0, quiet_s=0.05, every_s=60):
            time.sleep(0.5)
        with stage_watch("run_all speak (7/7)", expected_s=None, quiet_s=0.05, every_s=60):
            time.sleep(0.5)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    eta = r"run_all federate \(5/7\): \d+s in, ETA 1m\d\ds \(expected 2m00s\); the run's ETA 6m\d\ds"
    assert re.fullmatch(eta, lines[0]), lines[0]
    blind = r"run_all speak \(7/7\): \d+s in \(no earlier run to estimate the time left from\)"
    assert re.fullmatch(blind, lines[1]), lines[1]


def test_a_stage_whose_own_progress_shows_gets_no_second_line(caplog) -> None:
    watch = stage_watch("run_all build_base (3/7)", expected_s=60.0, quiet_s=0.3, every_s=60)
    with caplog.at_level(logging.INFO, logger="nimmer_train.progress"), watch:
        Progress("build_base", 10, every_s=0.0, stream=io.StringIO()).update(1, {"train_loss": 3.0})
        time.sleep(0.6)
    assert [r.getMessage() for r in caplog.records] == ["build_base: step 1/10 (10%), loss 3.000"]
