"""Ctrl-C as a user presses it: SIGINT to a running stage's whole process group (what a terminal
sends) ends it with one line naming the stage and how to resume, no traceback; the same command
again resumes from the stage's checkpoint."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.outputs import base_dir
from tests.helpers.pipelines import PIPELINE_TIMEOUT_S, run_pipeline

pytestmark = pytest.mark.slow
RESUME_LINE = "interrupted at stage train_loras; run the same command again to resume"


def _as_a_terminal_job() -> None:
    """A terminal's foreground job has SIGINT at its default; a job started with `&` by a
    non-interactive shell (how CI harnesses launch `make test`) inherits it *ignored*, and Python
    keeps it ignored, so without this the child would never see the Ctrl-C (CI exited 0, not 130)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_ends_with_one_line_and_the_same_command_resumes(tiny_run: Path, tmp_path: Path) -> None:
    overrides = (
        "experiment=ci_tiny",
        f"lora.base_dir={base_dir(tiny_run)}",
        "lora.max_steps=8",
        "lora.save_steps=2",
        "lora.eval_max_examples=4",
    )
    (tmp_path / "artifacts").mkdir()
    for inputs in ("corpus", "synth"):  # tiny_run's corpus and r1 (same fingerprints): reused
        (tmp_path / "artifacts" / inputs).symlink_to(tiny_run / "artifacts" / inputs)
    checkpoints = tmp_path / "artifacts/loras"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "pipelines.train_loras", f"paths.workdir={tmp_path}", *overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    with out.open("w") as stdout, err.open("w") as stderr:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            stdout=stdout,
            stderr=stderr,
            env=env,
            start_new_session=True,
            preexec_fn=_as_a_terminal_job,
        )
        deadline = time.monotonic() + PIPELINE_TIMEOUT_S  # a hang guard, not a speed bound
        try:
            while not list(checkpoints.glob("*/.work-*/checkpoints/checkpoint-*/trainer_state.json")):
                assert proc.poll() is None, f"train_loras ended before Ctrl-C:\n{err.read_text()}"
                assert time.monotonic() < deadline, "train_loras wrote no checkpoint"
                time.sleep(0.05)
            printed = (out.stat().st_size, err.stat().st_size)
            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=PIPELINE_TIMEOUT_S) == 130  # 128 + SIGINT, as a shell reports it
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    after = out.read_text()[printed[0] :] + err.read_text()[printed[1] :]
    assert "Traceback" not in out.read_text() + err.read_text()
    assert err.read_text().strip().splitlines()[-1] == RESUME_LINE
    lines = [line for line in after.splitlines() if line.strip()]
    assert len(lines) <= 3 and RESUME_LINE in lines  # (a progress line may land before it)
    assert not [p for p in checkpoints.glob("*/*") if not p.name.startswith(".")]  # nothing half-shown

    rerun = run_pipeline("train_loras", tmp_path, *overrides)
    assert "hivemind-broadcast: resuming from" in rerun.stdout + rerun.stderr
