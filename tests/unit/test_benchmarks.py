"""The benchmark comparison flags a moved ratio and not a stable one, compares only runs of the same
machine, and the harness refuses figures that break the benchmark contract, saying what to do.
Running every benchmark (smoke mode) and the runner: tests/e2e/test_benchmarks_smoke.py."""

from __future__ import annotations

import pytest

from benchmarks import compare
from benchmarks.harness import BenchmarkError, check_figures


def result(
    ratio: float, machine: str = "cpu | 2 cores | 2 torch threads", at: str = "2026-01-01T00:00:00"
) -> dict:
    return {
        "run_id": f"{machine}{at}{ratio}",
        "commit": "c" * 40,
        "machine": {"key": machine},
        "smoke": False,
        "started_at": at,
        "ratios": {"speed_ratio": ratio},
    }


def test_a_moved_ratio_is_flagged_and_a_stable_one_is_not() -> None:
    before = result(1.0, at="2026-01-01T00:00:00")
    stable = compare.rows("bench_x", result(1.05, at="2026-01-02T00:00:00"), before)
    moved = compare.rows("bench_x", result(0.85, at="2026-01-02T00:00:00"), before)
    assert not stable[0].moved(0.10) and moved[0].moved(0.10)
    assert "MOVED" not in compare.table(stable, 0.10) and "MOVED > 10%" in compare.table(moved, 0.10)
    assert not moved[0].moved(0.20)  # the tolerance is the caller's


def test_only_the_same_machines_latest_earlier_run_is_compared() -> None:
    now = result(2.0, at="2026-01-03T00:00:00")
    same_old = result(1.0, at="2026-01-01T00:00:00")
    same_latest = result(1.2, at="2026-01-02T00:00:00")
    other = result(9.0, machine="another cpu | 64 cores | 64 torch threads", at="2026-01-02T12:00:00")
    assert compare.previous([same_old, same_latest, other, now], now) is same_latest
    assert compare.previous([other, now], now) is None
    assert compare.rows("bench_x", now, None)[0].change() is None


@pytest.mark.parametrize(
    ("figures", "says"),
    [
        ([1.0], "return a dict"),
        ({"speed_ratio": 1.0}, '"goal"'),
        ({"speed": 1.0, "goal": "fast"}, "no headline ratio"),
        ({"speed_ratio": float("nan"), "goal": "fast"}, "finite number"),
    ],
)
def test_figures_that_break_the_contract_are_refused_with_what_to_do(figures: object, says: str) -> None:
    with pytest.raises(BenchmarkError, match="benchmarks/bench_x.py") as caught:
        check_figures("bench_x", figures)
    assert says in str(caught.value)
