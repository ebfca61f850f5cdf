"""`nimmer versions` takes --releases / --trusted-keys before or after its subcommand."""

from __future__ import annotations

from pathlib import Path

import pytest

from nimmer_train import cli


@pytest.mark.parametrize(
    "argv",
    [
        ["versions", "--releases", "{dir}", "verify", "v1"],
        ["versions", "verify", "v1", "--releases", "{dir}"],
        ["versions", "verify", "--releases", "{dir}", "v1"],
        ["versions", "--releases", "elsewhere", "verify", "v1", "--releases", "{dir}"],  # the later one wins
    ],
)
def test_release_options_go_where_users_put_them(argv: list[str], tmp_path: Path, capsys) -> None:
    assert cli.main([a.format(dir=tmp_path) for a in argv]) == 1
    assert f"no version registry at {tmp_path}/registry.sqlite" in capsys.readouterr().err


def test_every_level_shows_the_options_in_its_help(capsys) -> None:
    for argv in (["versions", "--help"], ["versions", "list", "--help"]):
        with pytest.raises(SystemExit):
            cli.main(argv)
        assert "--releases" in capsys.readouterr().out
