"""train_loras as a pipeline run on experiment=ci_tiny: a killed run resumes its adapter and does
not retrain finished ones (nor measure their held-out matrix again), registers with too little
data are skipped, QLoRA refuses without CUDA."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from nimmer_train.loras.evaluation import Evaluation
from tests.helpers.outputs import adapters as _adapters
from tests.helpers.outputs import only as _only
from tests.helpers.pipelines import kill_when, run_pipeline

pytestmark = pytest.mark.slow
TWO = ("hivemind-broadcast", "drunk-scavenger")


def test_killed_adapter_resumes_and_finished_ones_are_not_retrained(tiny_run: Path, tmp_path: Path) -> None:
    base_dir = _only(tiny_run / "artifacts/base")
    common = ("experiment=ci_tiny", f"lora.base_dir={base_dir}", "lora.max_steps=16", "lora.save_steps=4")
    (tmp_path / "artifacts").mkdir()
    for inputs in ("corpus", "synth"):  # the same corpus and r1 as tiny_run's (same fingerprints): reuse
        (tmp_path / "artifacts" / inputs).symlink_to(tiny_run / "artifacts" / inputs)
    loras = tmp_path / "artifacts/loras"

    def first_done_second_checkpointed() -> bool:
        published = [p for p in loras.glob("*/*") if not p.name.startswith(".")]
        done = loras.glob("*/.work-drunk-scavenger-*/checkpoints/checkpoint-*/trainer_state.json")
        return bool(published and list(done))

    kill_when("train_loras", tmp_path, *common, ready=first_done_second_checkpointed)
    assert len([p for p in loras.glob("*/*") if not p.name.startswith(".")]) == 1

    rerun = run_pipeline("train_loras", tmp_path, *common)
    assert "adapter hivemind-broadcast is up to date" in rerun.stdout + rerun.stderr
    assert "drunk-scavenger: resuming from" in rerun.stdout + rerun.stderr
    assert set(_adapters(tmp_path)) == set(TWO)

    # a run with nothing to train measures nothing: the held-out matrix is the one kept, whole
    kept = json.loads(next(loras.glob("*/evaluation.json")).read_text())
    again = run_pipeline("train_loras", tmp_path, *common)
    assert "held-out matrix of these adapters is up to date" in again.stdout + again.stderr
    assert json.loads(next(loras.glob("*/evaluation.json")).read_text()) == kept
    summary = {k: v for k, v in kept.items() if k not in ("adapters", "key", "samples")}
    assert Evaluation.from_summary(kept, kept["samples"]).summary() == summary


def test_registers_with_too_little_data_are_skipped(tiny_run: Path) -> None:
    proc = run_pipeline("train_loras", tiny_run, "experiment=ci_tiny", "lora.min_examples=1000")
    out = proc.stdout + proc.stderr
    assert "skipping register hivemind-broadcast" in out and "lora.min_examples=1000" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_qlora_fails_up_front_without_cuda(tiny_run: Path) -> None:
    proc = run_pipeline("train_loras", tiny_run, "experiment=ci_tiny", "lora=qlora", check=False)
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("error: lora=qlora loads the base in 4-bit")
