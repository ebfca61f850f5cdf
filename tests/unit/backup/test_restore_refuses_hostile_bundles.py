"""Adversarial review of ``nimmer backup restore`` (issue 42): the unsealed bundle's header is
the one input a restore trusts to name paths, so a path outside the folder, a size that lies or
two rows for one path are refused with nothing written; the folder is put in place only whole
(a restore that fails at the swap keeps the old folder, never a half one), and a LoRA folder
that is a symlink is refused, never followed or emptied."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nimmer_train.backup import player_loras
from nimmer_train.backup.player_loras import BUNDLE_FORMAT, pack, unpack
from nimmer_train.backup.sealing import BackupError

CONFIG = b'{"r": 4}'
WEIGHTS = bytes(range(256)) * 8


def _bundle(rows: list[tuple[str, bytes]], **lies: object) -> bytes:
    """A bundle whose header names ``rows`` (path, bytes); ``lies``: header fields of the first
    row replaced (a size or sha256 that does not match its bytes)."""
    files = [{"path": p, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for p, d in rows]
    files[0].update(lies)
    header = json.dumps({"format": BUNDLE_FORMAT, "files": files}).encode()
    return header + b"\n" + b"".join(d for _, d in rows)


def _tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(
    "path", ["../escaped", "/tmp/escaped", "sub/../../escaped", "..", "a\\..\\escaped", "", "./x"]
)
def test_restore_refuses_a_header_path_outside_the_folder(tmp_path: Path, path: str) -> None:
    target = tmp_path / "player" / "loras" / "voice"
    with pytest.raises(BackupError, match="is not inside its folder; nothing was restored"):
        unpack(_bundle([("adapter_config.json", CONFIG), (path, b"evil")]), target, "backup voice v1")
    assert not (tmp_path / "player").exists() and not (tmp_path / "escaped").exists()  # nothing written


@pytest.mark.parametrize(
    "lies", [{"size": 10**12}, {"size": -1}, {"size": 1}, {"size": "8"}, {"sha256": "0" * 64}]
)
def test_restore_refuses_a_header_size_or_hash_that_lies(tmp_path: Path, lies: dict) -> None:
    target = tmp_path / "loras" / "voice"
    bundle = _bundle([("adapter_config.json", CONFIG), ("w.safetensors", WEIGHTS)], **lies)
    with pytest.raises(BackupError, match="nothing was restored"):
        unpack(bundle, target, "backup voice v1")
    assert not target.exists()


@pytest.mark.parametrize(
    "rows",
    [
        [("a.json", CONFIG), ("a.json", CONFIG)],
        [("a", CONFIG), ("a/b.json", CONFIG)],
        [("a/b.json", CONFIG), ("a", CONFIG)],
    ],
)
def test_restore_refuses_two_rows_for_one_path_with_a_one_line_error(
    tmp_path: Path, rows: list[tuple[str, bytes]]
) -> None:
    target = tmp_path / "loras" / "voice"
    with pytest.raises(BackupError, match="names .* twice|inside a file"):
        unpack(_bundle(rows), target, "backup voice v1")
    assert not target.exists()


def test_restore_refuses_a_lora_folder_that_is_a_symlink_and_leaves_its_target(tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("not the player's")
    target = tmp_path / "loras" / "voice"
    target.parent.mkdir()
    target.symlink_to(elsewhere)
    with pytest.raises(BackupError, match="is a symlink"):
        unpack(_bundle([("adapter_config.json", CONFIG)]), target, "backup voice v1")
    assert target.is_symlink() and _tree(elsewhere) == {"keep.txt": b"not the player's"}


def test_a_restore_that_fails_at_the_swap_keeps_the_old_folder_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A crash between removing the old folder and renaming the new one in must not leave a
    half folder or none: the failure is injected at the rename (the only mock here: a kill at
    that instant cannot be timed)."""
    target = tmp_path / "loras" / "voice"
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_bytes(b'{"old": 1}')
    (target / "w.safetensors").write_bytes(b"old weights")
    before = _tree(target)
    real = os.replace

    def crash(src: object, dst: object) -> None:
        if Path(str(dst)) == target and ".restore-" in str(src):
            raise OSError("killed at the swap")
        real(src, dst)

    monkeypatch.setattr(player_loras.os, "replace", crash)
    with pytest.raises(OSError, match="killed at the swap"):
        unpack(
            _bundle([("adapter_config.json", CONFIG), ("w.safetensors", WEIGHTS)]), target, "backup voice v2"
        )
    assert _tree(target) == before
    assert [p.name for p in target.parent.iterdir()] == ["voice"]  # no staging or old copy left


def test_a_restored_folder_is_the_bundle_exactly_with_private_modes(tmp_path: Path) -> None:
    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "adapter_config.json").write_bytes(CONFIG)
    (source / "sub" / "w.safetensors").write_bytes(WEIGHTS)
    target = tmp_path / "loras" / "voice"
    target.mkdir(parents=True)
    (target / "stale.bin").write_bytes(b"from before")
    unpack(pack(source), target, "backup voice v1")
    assert _tree(target) == _tree(source)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in target.rglob("*") if p.is_file())
    assert stat.S_IMODE(target.stat().st_mode) & 0o077 == 0  # the folder: the player's only
    assert [p.name for p in target.parent.iterdir()] == ["voice"]


def test_a_restore_killed_mid_write_leaves_the_old_folder_and_the_next_restore_cleans_up(
    tmp_path: Path,
) -> None:
    """A real SIGKILL of a restoring process while it writes the new folder: the old folder is
    still there whole, its leftover is a hidden staging folder, and the next restore removes it."""
    target = tmp_path / "loras" / "voice"
    target.mkdir(parents=True)
    (target / "adapter_config.json").write_bytes(b'{"old": 1}')
    before = _tree(target)
    rows = [(f"w{i:02d}.safetensors", os.urandom(1 << 20)) for i in range(48)]
    bundle = _bundle([("adapter_config.json", CONFIG), *rows])
    (tmp_path / "bundle").write_bytes(bundle)
    script = (
        "import sys; from pathlib import Path; from nimmer_train.backup.player_loras import unpack; "
        "unpack(Path(sys.argv[1]).read_bytes(), Path(sys.argv[2]), 'backup voice v2')"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "bundle"), str(target)])
    deadline = time.monotonic() + 120  # a hang guard, not a timing assertion
    while not any(p.name.startswith(".voice.restore-") and any(p.iterdir()) for p in target.parent.iterdir()):
        assert proc.poll() is None and time.monotonic() < deadline, "the restore ended before it was killed"
        time.sleep(0.005)
    proc.kill()
    proc.wait()
    assert _tree(target) == before
    assert [p.name.startswith(".voice.restore-") for p in sorted(target.parent.iterdir())] == [True, False]
    unpack(bundle, target, "backup voice v2")
    assert _tree(target) == dict([("adapter_config.json", CONFIG), *rows])
    assert [p.name for p in target.parent.iterdir()] == ["voice"]
