"""train_loras' kept held-out matrix: an evaluation.json that is not the stage's own object (hand
edited, another tool's) is measured again, never a crash of the stage."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from nimmer_train.loras import stage


@pytest.mark.parametrize("text", ["[]", '"text"', "3", "null"])
def test_an_evaluation_file_that_is_not_an_object_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    (tmp_path / stage.EVALUATION).write_text(text)
    measured = SimpleNamespace(summary=lambda: {"registers": ["a"]}, samples=[])
    monkeypatch.setattr(stage, "evaluate", lambda *args: measured)
    inputs = SimpleNamespace(root=tmp_path, base_dir=tmp_path / "base-0123")
    cfg = SimpleNamespace(lora=SimpleNamespace(eval_max_examples=8, max_length=512, dtype="float32"))
    adapters = {"a": tmp_path / "a-0123"}
    assert stage._evaluation(inputs, adapters, {}, cfg) is measured
