"""Artifact folders on disk: a staged folder appears whole or not at all; a secret file is
written whole, 0600, never through a symlink and never over a key unless asked."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from nimmer_train import artifacts
from nimmer_train.artifacts import atomic_dir, write_bytes_atomic, write_secret


def test_atomic_dir_leaves_nothing_on_failure(tmp_path: Path) -> None:
    final = tmp_path / "out"
    with pytest.raises(RuntimeError), atomic_dir(final) as staging:
        (staging / "half.bin").write_bytes(b"x")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with atomic_dir(final) as staging:
        (staging / "whole.bin").write_bytes(b"x")
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_secret_is_0600_whatever_the_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        write_secret(tmp_path / "key", b"secret")
        write_bytes_atomic(tmp_path / "profile", b"private", private=True)
    finally:
        os.umask(old)
    for name in ("key", "profile"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o600
    assert (tmp_path / "key").read_bytes() == b"secret"


def test_a_secret_is_never_overwritten_unless_asked(tmp_path: Path) -> None:
    key = tmp_path / "key"
    write_secret(key, b"first")
    with pytest.raises(FileExistsError):
        write_secret(key, b"second")
    assert key.read_bytes() == b"first" and [p.name for p in tmp_path.iterdir()] == ["key"]
    write_secret(key, b"rotated", overwrite=True)
    assert key.read_bytes() == b"rotated" and [p.name for p in tmp_path.iterdir()] == ["key"]


def test_a_symlink_at_the_secret_or_its_temp_path_is_not_followed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loot = tmp_path / "loot"
    loot.write_bytes(b"")
    folder = tmp_path / "keys"
    folder.mkdir()
    (folder / "key").symlink_to(loot)  # planted at the key's path: refused, not written through
    with pytest.raises(FileExistsError):
        write_secret(folder / "key", b"secret")
    write_secret(folder / "other", b"secret", overwrite=True)  # a symlink over-written, not followed
    monkeypatch.setattr(artifacts.secrets, "token_hex", lambda n: "guessed")
    (folder / f".next.tmp-{os.getpid()}-guessed").symlink_to(loot)  # planted at the temp's path
    with pytest.raises(FileExistsError):
        write_secret(folder / "next", b"secret")
    (folder / "swap").symlink_to(loot)
    write_secret(folder / "swap", b"secret", overwrite=True)
    assert loot.read_bytes() == b"" and not (folder / "next").exists()
    assert not (folder / "swap").is_symlink() and (folder / "swap").read_bytes() == b"secret"


def test_no_partial_secret_is_ever_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "key"
    seen: list[bool] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:  # the moment the bytes are written but not yet durable
        seen.append(key.exists())
        real_fsync(fd)

    monkeypatch.setattr(artifacts.os, "fsync", fsync)
    write_secret(key, b"whole")
    assert seen[0] is False and key.read_bytes() == b"whole"

    def killed(fd: int) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(artifacts.os, "fsync", killed)
    with pytest.raises(OSError, match="disk gone"):
        write_secret(tmp_path / "new", b"half")
    with pytest.raises(OSError, match="disk gone"):
        write_secret(key, b"half", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["key"] and key.read_bytes() == b"whole"
