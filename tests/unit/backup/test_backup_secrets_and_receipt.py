"""Adversarial review of ``nimmer backup`` (issue 42) at the command line, over the real host on
loopback: the passphrase and recovery codes are never an argument and reach no file, log or
output, and a tampered local receipt is a one-line error before any LoRA folder is touched."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest

from nimmer_train.backup.player_loras import LORAS, RECEIPT
from nimmer_train.cli import main
from tests.unit.backup.test_backup_command import NAME, PASSPHRASE, _backup, _player, adapter, host  # noqa: F401


def test_the_passphrase_is_no_argument_and_reaches_no_file_log_or_output(
    host: tuple[str, Path],  # noqa: F811
    adapter: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, _ = host
    player = _player(tmp_path, adapter)
    with pytest.raises(SystemExit):  # argparse: no such option
        main(["backup", "create", str(player), NAME, "--passphrase", PASSPHRASE, "--host", url])
    capsys.readouterr()
    caplog.set_level(logging.DEBUG)
    assert _backup(monkeypatch, url, "create", str(player), NAME) == 0
    out = capsys.readouterr().out
    codes = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert len(codes) == 8 and PASSPHRASE not in out
    shutil.rmtree(player / LORAS / NAME)
    assert _backup(monkeypatch, url, "restore", str(player)) == 0
    captured = capsys.readouterr()
    secrets = [PASSPHRASE.encode(), *(c.encode() for c in codes)]
    written = [p.read_bytes() for p in tmp_path.rglob("*") if p.is_file() and not p.is_symlink()]
    assert not [s for s in secrets if any(s in data for data in written)]  # host folder included
    assert not [s for s in secrets if s.decode() in captured.out + captured.err + caplog.text]


def test_a_tampered_receipt_is_one_line_and_no_folder_is_touched(
    host: tuple[str, Path],  # noqa: F811
    adapter: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = host
    player = _player(tmp_path, adapter)
    assert _backup(monkeypatch, url, "create", str(player), NAME) == 0
    shutil.rmtree(player / LORAS / NAME)  # lost, and its receipt garbled
    (player / RECEIPT).write_text("{not json")
    capsys.readouterr()
    assert _backup(monkeypatch, url, "list", str(player)) == 0  # a missing folder needs no receipt
    assert _backup(monkeypatch, url, "restore", str(player), NAME) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and RECEIPT in err[0] and "move it aside" in err[0]
    assert not (player / LORAS / NAME).exists()  # refused before anything was put in place
    (player / RECEIPT).unlink()
    assert _backup(monkeypatch, url, "restore", str(player), NAME) == 0
    assert (player / LORAS / NAME / "adapter_config.json").is_file() and (player / RECEIPT).is_file()
