"""run_all's closing summary: a base trained from scratch says where real voices are."""

from __future__ import annotations

import contextlib
import json
from types import SimpleNamespace

from nimmer_train.errors import NimmerError
from nimmer_train.run_all import RunAllResult, federation_line, print_summary, voice_line
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


def test_the_summary_shows_each_versions_voice_and_the_stage_times(tmp_path, capsys) -> None:
    row = {"schema_valid": 1.0, "english_rate": 0.98, "distinct_2": 0.61, "turns": 40}
    registers = [
        {**row, "register": "caste-preacher", "register_accuracy": 1.0, "turns": 8},
        {**row, "register": "imperial-ceremony-chorus", "register_accuracy": 0.5, "turns": 8},
    ]
    report = {"overall": {**row, "register": "all", "register_accuracy": 0.75}, "registers": registers}
    (tmp_path / "manifest.json").write_text(json.dumps({"voice_report": report}))
    version = SimpleNamespace(label="nimmerworld-base-v1", folder=tmp_path)
    result = _result()
    result.publish = SimpleNamespace(versions=[version])  # type: ignore[assignment]
    result.seconds = {"ingest": 4.2, "build_base": 125.0}
    cfg = config("experiment=demo", "tracking.enabled=false", f"publish.releases_dir={tmp_path}/rel")
    with contextlib.suppress(NimmerError):  # no registry here: the listing after the voices fails
        print_summary(cfg, result)
    out = capsys.readouterr().out
    assert (
        "nimmerworld-base-v1 voices: schema-valid 1.00, English 0.98, register accuracy 0.75, weakest "
        "imperial-ceremony-chorus 0.50, distinct-2 0.61 (40 turns); bar FAILS: register accuracy "
        "(all registers), register accuracy (imperial-ceremony-chorus), replies repeating"
    ) in out
    assert "stage times: ingest 4s, build_base 2m05s; total 2m09s" in out
    assert voice_line("v0", tmp_path / "nowhere") is None


def test_the_summary_says_the_federated_gain_with_its_interval_and_epsilon_and_a_gain_at_0_as_none() -> None:
    gain = {"gain": 0.021, "low": 0.004, "high": 0.037}
    fed = {"heldout_gain": gain, "epsilon_a1_user_level": 4.57, "delta": 1e-6, "no_privacy": False}
    line = federation_line({"register": "caste-preacher", "federation": fed})
    assert line == (
        "federated caste-preacher gain +0.021 nats/token [+0.004, +0.037] over its start adapter, "
        "A.1 epsilon 4.57 at delta 1e-06"
    )
    fresh = federation_line({"register": "caste-preacher", "federation": fed, "fresh_start": {"rank": 1}})
    assert fresh is not None and "over the base (a fresh adapter), A.1 epsilon 4.57" in fresh
    fed["heldout_gain"] = {"gain": -0.93, "low": -1.04, "high": -0.82}
    assert "(no gain at this epsilon)" in federation_line({"register": "r", "federation": fed})
    assert federation_line({"register": "r", "federation": {"heldout_gain": None}}) is None
