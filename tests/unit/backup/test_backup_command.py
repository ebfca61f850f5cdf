"""``nimmer backup create|list|restore`` (issue 42) over the real hardened backup host on loopback:
a player's LoRA folder (a real PEFT adapter of a tiny model built here) is sealed on the device,
uploaded, listed, and restored into place when it is missing or damaged, loadable again by PEFT;
a LoRA that loads but changed since its backup is kept unless the player asks; a tampered blob, a
foreign blob served in place of the device's own, and a wrong passphrase are each refused with
one line naming the backup, and the local folder is left as it was."""

from __future__ import annotations

import io
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from nimmer_train.backup.player_loras import KEY_FILE, LORAS, RECEIPT
from nimmer_train.backup.service import local_app
from nimmer_train.cli import main
from tests.helpers.loopback import serve_app

PASSPHRASE = "correct horse battery staple"
NAME = "companion-voice"


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A PEFT LoRA folder on a tiny Llama built here (random, non-zero LoRA weights)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2
    )
    model = get_peft_model(
        LlamaForCausalLM(config),
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    folder = tmp_path_factory.mktemp("adapter") / NAME
    model.save_pretrained(folder)
    return folder


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """(URL, files) of the backup host on a free loopback port."""
    with serve_app(local_app(tmp_path / "host")) as url:
        yield url, tmp_path / "host"


def _player(tmp_path: Path, adapter: Path, name: str = "player") -> Path:
    folder = tmp_path / name
    shutil.copytree(adapter, folder / LORAS / NAME)
    return folder


def _backup(monkeypatch: pytest.MonkeyPatch, url: str, *words: str, secret: str = PASSPHRASE) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO(secret + "\n"))
    command, player, *rest = words
    return main(["backup", command, player, *rest, "--host", url])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_create_list_and_restore_a_missing_lora_with_a_recovery_code(
    host: tuple[str, Path],
    adapter: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from peft import PeftConfig

    url, stored = host
    player = _player(tmp_path, adapter)
    assert _backup(monkeypatch, url, "create", str(player), NAME) == 0
    assert f"backed up {NAME} v1" in capsys.readouterr().out
    assert (player / KEY_FILE).stat().st_mode & 0o077 == 0  # the device's account key
    assert _backup(monkeypatch, url, "create", str(player), NAME) == 0  # the next version
    out = capsys.readouterr().out
    codes = [line.strip() for line in out.splitlines() if line.startswith("  ")]
    assert f"backed up {NAME} v2" in out and len(codes) == 8
    weights = (player / LORAS / NAME / "adapter_model.safetensors").read_bytes()
    host_bytes = b"".join(p.read_bytes() for p in stored.rglob("*") if p.is_file())
    assert not any(weights[i : i + 32] in host_bytes for i in range(256, len(weights) - 32, 509))
    original = _files(player / LORAS / NAME)
    shutil.rmtree(player / LORAS / NAME)  # the device lost its LoRA
    assert _backup(monkeypatch, url, "list", str(player)) == 0
    listing = capsys.readouterr().out
    assert f"{NAME}  v1" in listing and f"{NAME}  v2" in listing and f"{NAME}: missing" in listing
    assert _backup(monkeypatch, url, "restore", str(player), "--recovery-code", secret=codes[5].lower()) == 0
    assert f"restored {NAME} v2" in capsys.readouterr().out
    assert _files(player / LORAS / NAME) == original
    assert all(p.stat().st_mode & 0o077 == 0 for p in (player / LORAS / NAME).iterdir())  # the player's only
    assert PeftConfig.from_pretrained(str(player / LORAS / NAME)).r == 4  # PEFT reads it again
    assert _backup(monkeypatch, url, "list", str(player)) == 0
    assert f"{NAME}: backed up as v2" in capsys.readouterr().out


def test_a_damaged_lora_is_restored_and_a_changed_one_kept(
    host: tuple[str, Path],
    adapter: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = host
    player = _player(tmp_path, adapter)
    assert _backup(monkeypatch, url, "create", str(player), NAME) == 0
    weights = player / LORAS / NAME / "adapter_model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[: len(original) // 2])  # a write cut short
    assert _backup(monkeypatch, url, "list", str(player)) == 0
    assert f"{NAME}: damaged: adapter_model.safetensors cannot be opened" in capsys.readouterr().out
    assert _backup(monkeypatch, url, "restore", str(player)) == 0
    assert weights.read_bytes() == original
    config = player / LORAS / NAME / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "lora_dropout": 0.25}))  # it moved on
    capsys.readouterr()
    assert _backup(monkeypatch, url, "restore", str(player)) == 0
    assert "nothing to restore" in capsys.readouterr().out
    assert _backup(monkeypatch, url, "restore", str(player), NAME) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "changed since v1" in err[0] and "--overwrite" in err[0]
    assert _backup(monkeypatch, url, "restore", str(player), NAME, "--overwrite") == 0
    assert "lora_dropout" in config.read_text() and json.loads(config.read_text())["lora_dropout"] != 0.25


def test_tampered_foreign_and_wrongly_unlocked_backups_are_refused_by_name(
    host: tuple[str, Path],
    adapter: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, stored = host
    mine, theirs = _player(tmp_path, adapter, "mine"), _player(tmp_path, adapter, "theirs")
    for player in (mine, theirs):
        assert _backup(monkeypatch, url, "create", str(player), NAME) == 0
    capsys.readouterr()
    my_id = json.loads((mine / RECEIPT).read_text())[NAME]["backup_id"]
    their_id = json.loads((theirs / RECEIPT).read_text())[NAME]["backup_id"]
    shutil.rmtree(mine / LORAS / NAME)

    def refused(*words: str, secret: str = PASSPHRASE) -> str:
        assert _backup(monkeypatch, url, "restore", str(mine), *words, secret=secret) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"error: backup {NAME} v1 ({my_id}): ")
        assert not (mine / LORAS / NAME).exists()  # nothing was put in place
        return err[0]

    assert "wrong passphrase" in refused(NAME, secret="not the passphrase at all")
    blob = stored / "blobs" / my_id
    sealed = blob.read_bytes()
    data = json.loads(sealed)
    flipped = (
        data["ciphertext"][:40] + ("A" if data["ciphertext"][40] != "A" else "B") + data["ciphertext"][41:]
    )
    blob.write_text(json.dumps({**data, "ciphertext": flipped}))
    assert "changed or is corrupt" in refused(NAME)
    blob.write_bytes((stored / "blobs" / their_id).read_bytes())  # the host serves another account's
    line = refused()
    assert f"the host answered {their_id} of account" in line and "refusing it" in line
