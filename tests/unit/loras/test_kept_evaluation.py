"""train_loras' kept held-out matrix: reused only for the same adapter and base bytes, code and
settings; an evaluation.json that is not the stage's own object (hand edited, another tool's) is
measured again, never a crash of the stage."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from nimmer_train.loras import stage
from nimmer_train.loras.evaluation import Cell, Estimate, Evaluation, Scores
from tests.helpers.compose import config


@pytest.mark.parametrize("text", ["[]", '"text"', "3", "null"])
def test_an_evaluation_file_that_is_not_an_object_is_measured_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str
) -> None:
    (tmp_path / stage.EVALUATION).write_text(text)
    measured = SimpleNamespace(summary=lambda: {"registers": ["a"]}, samples=[])
    monkeypatch.setattr(stage, "evaluate", lambda *args: measured)
    inputs = SimpleNamespace(root=tmp_path, base_dir=tmp_path / "base-0123")
    cfg = config("experiment=ci_tiny")
    adapters = {"a": tmp_path / "a-0123"}
    assert stage._evaluation(inputs, adapters, {}, cfg) is measured


def test_the_kept_matrix_is_reused_only_for_the_same_adapter_bytes_code_and_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rerun reads the kept matrix; an adapter retrained under the same folder name (other
    bytes), another sample budget or another seed measures again."""
    adapter = tmp_path / "a-0123"
    adapter.mkdir()
    (adapter / "manifest.json").write_text('{"files": [["adapter_model.safetensors", "aaa"]]}')
    calls = []
    scores = {name: {cls: _scores() for cls in stage.TOKEN_CLASSES} for name in stage.EVAL_SETS}
    measured = Evaluation(["a"], scores, [{"register": "a", "text": "t"}])

    def evaluate(*args: object) -> Evaluation:
        calls.append(1)
        return measured

    monkeypatch.setattr(stage, "evaluate", evaluate)
    inputs = SimpleNamespace(root=tmp_path, base_dir=tmp_path / "base-0123")
    cfg = config("experiment=ci_tiny")
    first = stage._evaluation(inputs, {"a": adapter}, {}, cfg)
    again = stage._evaluation(inputs, {"a": adapter}, {}, cfg)
    assert len(calls) == 1 and again.summary() == first.summary() and again.samples == first.samples
    (adapter / "manifest.json").write_text('{"files": [["adapter_model.safetensors", "bbb"]]}')
    stage._evaluation(inputs, {"a": adapter}, {}, cfg)
    assert len(calls) == 2  # same folder name, other bytes
    stage._evaluation(
        inputs, {"a": adapter}, {}, config("experiment=ci_tiny", "lora.sample_max_new_tokens=7")
    )
    stage._evaluation(inputs, {"a": adapter}, {}, config("experiment=ci_tiny", "lora.seed=5"))
    assert len(calls) == 4


def _scores() -> Scores:
    cell = Cell(2.0, 1.9, 2.1, 4, 100)
    nan = Estimate(float("nan"), float("nan"), float("nan"))
    return Scores(["a"], {"a": {"base": cell, "a": cell}}, Estimate(1.0, 1.0, 1.0), nan, {"a": nan})
