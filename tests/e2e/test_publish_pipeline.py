"""The publish pipeline killed midway (the publisher's drills): no version and no registry row are
left, and the next run cleans up and publishes."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from nimmer_train.errors import NimmerError
from nimmer_train.publish.registry import Registry
from nimmer_train.publish.release import DRILL
from nimmer_train.publish.versions import open_version
from tests.helpers import REPO
from tests.helpers.outputs import base_dir as _base
from tests.helpers.outputs import keyring as _keyring
from tests.helpers.pipelines import PIPELINE_TIMEOUT_S

pytestmark = pytest.mark.slow


def _publish(workdir: Path, base: Path, drill: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != DRILL}
    if drill:
        env[DRILL] = drill
    cmd = [
        sys.executable,
        "-m",
        "pipelines.publish",
        f"paths.workdir={workdir}",
        f"publish.base_dir={base}",
        "publish.merge_federated=false",
        "tracking.enabled=false",
        "publish.adapters=[]",  # the drills are the base's release: no register adapters
        "publish.voice_eval.enabled=false",  # the drills are the release's, not the card's measures
    ]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=PIPELINE_TIMEOUT_S)


def test_publisher_killed_midway_leaves_no_version_and_no_row(tiny_run: Path, tmp_path: Path) -> None:
    base = tmp_path / "base"
    shutil.copytree(_base(tiny_run), base)
    releases = tmp_path / "releases"
    for drill in ("staged", "renamed"):
        proc = _publish(tmp_path, base, drill)
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        registry = Registry.open(releases)
        assert registry.versions() == [] and registry.aliases() == {}
        registry.close()
        with pytest.raises(NimmerError, match="no version 'v1'"):
            open_version(releases, "v1", _keyring(tmp_path))
    assert (releases / "nimmerworld-base-v1").is_dir()  # renamed, never committed: not a version
    proc = _publish(tmp_path, base, None)
    assert proc.returncode == 0, proc.stderr
    assert "removed nimmerworld-base-v1, left by an interrupted publish" in proc.stdout + proc.stderr
    assert open_version(releases, "v1", _keyring(tmp_path)).label == "nimmerworld-base-v1"
    assert not list(releases.glob(".*"))
    assert "nimmerworld-base-v1" in proc.stdout  # the versions table
