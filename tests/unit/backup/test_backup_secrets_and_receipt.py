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


@pytest.mark.parametrize("name", ["../../escaped", "/tmp/escaped", "..", ".hidden"])
def test_a_hostile_listing_cannot_name_a_folder_outside_the_players_loras(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """A host that lists a backup under a name that is a path: restore with no name (every
    missing one) refuses it with one line and writes nothing."""
    import base64

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from nimmer_train.backup.device import account_id
    from tests.helpers.loopback import serve_app

    async def accounts(request: object) -> JSONResponse:
        public = base64.b64decode((await request.json())["public_key"])  # type: ignore[attr-defined]
        return JSONResponse({"account": account_id(public)})

    async def listing(request: object) -> JSONResponse:
        row = {"lora_name": name, "lora_version": 1, "backup_id": "b" * 32, "size_bytes": 1}
        return JSONResponse([{**row, "backed_up_at": 0}])

    app = Starlette(
        routes=[Route("/accounts", accounts, methods=["POST"]), Route("/accounts/{a}/backups", listing)]
    )
    player = tmp_path / "player"
    player.mkdir()
    with serve_app(app) as url:
        assert _backup(monkeypatch, url, "restore", str(player)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "LoRA name" in err[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["backup_key.pem", "player"]
