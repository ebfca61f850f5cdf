"""run_all's closing summary: a base trained from scratch says where real voices are."""

from __future__ import annotations

from types import SimpleNamespace

from nimmer_train.run_all import RunAllResult, print_summary
from tests.helpers.compose import config


def _result() -> RunAllResult:
    path = SimpleNamespace(path="p")
    loras = SimpleNamespace(root="r", evaluation=None)
    return RunAllResult(path, path, path, loras, None, None, None)  # type: ignore[arg-type]


def test_a_scratch_base_points_to_the_real_base_and_a_pretrained_one_does_not(capsys) -> None:
    print_summary(config("experiment=ci_tiny", "tracking.enabled=false"), _result())
    assert "make demo EXPERIMENT=real_small" in capsys.readouterr().out
    print_summary(config("experiment=real_small", "tracking.enabled=false"), _result())
    assert "EXPERIMENT=real_small" not in capsys.readouterr().out
