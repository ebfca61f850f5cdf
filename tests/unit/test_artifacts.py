"""Artifact folders on disk: a staged folder appears whole or not at all."""

from __future__ import annotations

from pathlib import Path

import pytest

from nimmer_train.artifacts import atomic_dir


def test_atomic_dir_leaves_nothing_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_dir(final) as staging:
        (staging / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(final) as staging:
        (staging / "whole.bin").write_bytes(b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
