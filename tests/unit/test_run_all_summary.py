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
    print_summary(config("experiment=tiny", "tracking.enabled=false"), _result())
    out = capsys.readouterr().out
    assert "trained from scratch" in out and "\n  make demo\n" in out
    print_summary(config("experiment=demo", "tracking.enabled=false"), _result())
    assert "trained from scratch" not in capsys.readouterr().out
