"""run_all's progress on stages without steps of their own: each stage's ETA comes from what it
took the last time it did work (recorded in paths.artifacts), a stage that found its output
(10 s or less) does not overwrite that, and the stages run_all will run are counted."""

from __future__ import annotations

import contextlib

from nimmer_train import run_all
from nimmer_train.run_all import FIRST_RUN, TIMES, _record_time, _stages, stage_times, watched
from tests.helpers.compose import config


def test_stage_times_are_recorded_when_the_stage_did_work(tmp_path) -> None:
    cfg = config("experiment=tiny", "tracking.enabled=false", f"paths.workdir={tmp_path}")
    assert stage_times(cfg) == FIRST_RUN.get("tiny", {})
    _record_time(cfg, "federate", 95.04)
    _record_time(cfg, "federate", 2.0)  # found its output: not what the stage costs
    _record_time(cfg, "ingest", 4.0)
    assert (tmp_path / "artifacts" / TIMES).exists()
    assert stage_times(cfg)["federate"] == 95.0 and "ingest" not in stage_times(cfg)
    other = config("experiment=demo", "tracking.enabled=false", f"paths.workdir={tmp_path}")
    assert "federate" not in stage_times(other) or stage_times(other)["federate"] != 95.0


def test_the_stages_counted_are_the_ones_that_run() -> None:
    cfg = config("experiment=demo", "tracking.enabled=false")
    first = ["ingest", "synthesize", "build_base", "train_loras"]
    assert _stages(cfg) == [*first, "federate", "publish", "speak"]
    off = config("experiment=demo", "federated.enabled=false", "publish.enabled=false")
    assert _stages(off) == first


def test_a_stage_that_fails_records_no_time(tmp_path, monkeypatch) -> None:
    cfg = config("experiment=tiny", "tracking.enabled=false", f"paths.workdir={tmp_path}")
    clock = iter([0.0, 0.0, 30.0, 100.0, 100.0, 160.0])  # each stage: its start, its end
    monkeypatch.setattr(run_all.time, "perf_counter", lambda: next(clock, 200.0))
    with watched(cfg, "publish"):
        pass
    with contextlib.suppress(RuntimeError), watched(cfg, "federate"):
        raise RuntimeError("killed")
    assert stage_times(cfg) == {"publish": 30.0}
