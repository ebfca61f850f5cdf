"""Encrypted LoRA backups: sealed on the device, stored by a real HTTP service on loopback as
ciphertext only, restored with the passphrase or a recovery code; wrong secrets and tampering
fail with a clear error."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from nimmer_train.backup.device import DeviceKey
from nimmer_train.backup.sealing import BackupError, Sealed, seal, unseal
from nimmer_train.backup.service import BackupClient, local_app
from tests.helpers.loopback import serve_app

PASSPHRASE = "correct horse battery staple"


@pytest.fixture
def host(tmp_path: Path) -> Iterator[tuple[BackupClient, Path]]:
    """The backup service on a free loopback port, its files under tmp_path/host; the client's
    device is registered (its account id comes from its key)."""
    with serve_app(local_app(tmp_path / "host")) as url:
        client = BackupClient(url, DeviceKey.generate())
        client.register()
        yield client, tmp_path / "host"


def _lora() -> bytes:
    generator = torch.Generator().manual_seed(0)
    return save({f"layer{i}.lora_A": torch.randn(8, 64, generator=generator) for i in range(4)})


def test_round_trip_through_the_host_keeps_only_ciphertext(host: tuple[BackupClient, Path]) -> None:
    client, folder = host
    lora = _lora()
    sealed, codes = seal(lora, PASSPHRASE, {"lora_name": "gameplay-voice", "lora_version": 3}, client.account)
    backup_id = client.upload(sealed)
    (row,) = client.list()
    assert (
        row["lora_name"] == "gameplay-voice" and row["lora_version"] == 3 and row["size_bytes"] == len(lora)
    )
    assert unseal(client.download(backup_id), passphrase=PASSPHRASE) == lora
    assert unseal(client.download(backup_id), recovery_code=codes[3].lower()) == lora
    stored = b"".join(p.read_bytes() for p in folder.rglob("*") if p.is_file())
    windows = [lora[i : i + 32] for i in range(64, len(lora) - 32, 997)]  # tensor bytes, not the header
    assert windows and not any(w in stored for w in windows)
    assert PASSPHRASE.encode() not in stored and not any(c.encode() in stored for c in codes)


def test_wrong_secrets_and_tampering_fail_clearly(host: tuple[BackupClient, Path]) -> None:
    client, folder = host
    sealed, _ = seal(_lora(), PASSPHRASE, {"lora_name": "v", "lora_version": 1}, client.account)
    backup_id = client.upload(sealed)
    with pytest.raises(BackupError, match="wrong passphrase"):
        unseal(client.download(backup_id), passphrase="not the passphrase")
    with pytest.raises(BackupError, match="wrong recovery code"):
        unseal(client.download(backup_id), recovery_code="AAAAA-BBBBB-CCCCC-DDDDD")
    blob = folder / "blobs" / backup_id
    data = json.loads(blob.read_bytes())
    ciphertext = bytearray(data["ciphertext"].encode())
    ciphertext[10] = ord("A") if ciphertext[10] != ord("A") else ord("B")
    blob.write_bytes(json.dumps({**data, "ciphertext": ciphertext.decode()}).encode())
    with pytest.raises(BackupError, match="changed or is corrupt"):
        unseal(client.download(backup_id), passphrase=PASSPHRASE)
    blob.write_bytes(b"{not json")
    with pytest.raises(BackupError, match="not a sealed LoRA"):
        client.download(backup_id)
    renamed = dataclasses.replace(sealed, metadata={**sealed.metadata, "lora_version": 2})
    with pytest.raises(BackupError, match="tampered"):
        unseal(renamed, passphrase=PASSPHRASE)
    with pytest.raises(BackupError, match="already backed up"):
        client.upload(sealed)
    assert isinstance(Sealed.from_bytes(sealed.to_bytes()), Sealed)
