"""Exploit tests for published versions and publisher keys (issue 21, items 5-7): each performs
the attack a review reproduced against a copy of a real published release (real registry SQLite,
real files) and shows that it now fails; the private copy that ``load_model`` loads from is made
from at most the bytes that were signed, and a file swapped for a FIFO fails instead of hanging."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sqlite3
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from nimmer_train import cli
from nimmer_train.errors import NimmerError
from nimmer_train.publish import versions
from nimmer_train.publish.manifest import SIGNATURE, IntegrityError
from nimmer_train.publish.signing import Keyring, SignatureError, generate_key, load_private, sign
from nimmer_train.publish.versions import (
    VerifiedVersion,
    load_model,
    load_verified,
    open_version,
    verified_copy,
)
from tests.helpers.outputs import keyring as _keyring


@pytest.fixture
def releases(tiny_run: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny run's releases and keys (attacks edit it freely)."""
    shutil.copytree(tiny_run / "keys", tmp_path / "keys")
    shutil.copytree(tiny_run / "releases", tmp_path / "releases")
    return tmp_path / "releases"


def _db(releases: Path) -> sqlite3.Connection:
    return sqlite3.connect(releases / "registry.sqlite", isolation_level=None)


def _lora(releases: Path, register: str, version: int) -> Path:
    """The folder of ``register``'s LoRA that version ``version``'s signed manifest lists."""
    manifest = json.loads((releases / f"nimmerworld-base-v{version}" / "manifest.json").read_text())
    (path,) = [c["path"] for c in manifest["compatible_loras"] if c["register"] == register]
    return releases / path


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


# 5. LoRAs and labels are trusted from the signed manifest, never from the registry alone


@pytest.mark.slow
def test_registry_edits_cannot_add_move_or_relabel(releases: Path, tmp_path: Path) -> None:
    keys = _keyring(tmp_path)
    assert set(open_version(releases, "v2", keys).loras) == {"drunk-scavenger"}
    db = _db(releases)
    v1_id, v2_id = (
        db.execute("SELECT version_id FROM base_model_versions WHERE version_number = ?", (n,)).fetchone()[0]
        for n in (1, 2)
    )

    def refused(*words: str) -> None:
        with pytest.raises(IntegrityError) as info:
            open_version(releases, "v2", keys)
        assert all(w in str(info.value) for w in words), str(info.value)

    # a LoRA the signed manifest of v2 does not list (hivemind fits v1 only) added to v2
    hivemind = db.execute(
        "SELECT lora_id FROM register_loras WHERE register = 'hivemind-broadcast'"
    ).fetchone()[0]
    db.execute("INSERT INTO lora_compat VALUES (?, ?, 'trained_on')", (hivemind, v2_id))
    refused(hivemind, "signed manifest does not")
    db.execute("DELETE FROM lora_compat WHERE lora_id = ? AND version_id = ?", (hivemind, v2_id))
    # the fitting LoRA's path pointed outside releases/ at a copy with matching hashes
    drunk = _lora(releases, "drunk-scavenger", 2)
    outside = tmp_path / "elsewhere" / drunk.name
    shutil.copytree(drunk, outside)
    (row_path,) = db.execute("SELECT path FROM register_loras WHERE lora_id = ?", (drunk.name,)).fetchone()
    for bad in (str(outside), f"../elsewhere/{drunk.name}", f"loras/../../elsewhere/{drunk.name}"):
        db.execute("UPDATE register_loras SET path = ? WHERE lora_id = ?", (bad, drunk.name))
        refused("drunk-scavenger")
    db.execute("UPDATE register_loras SET path = ? WHERE lora_id = ?", (row_path, drunk.name))
    # the registry's file hashes edited to match a changed adapter: the manifest's hashes rule
    _flip(drunk / "adapter_model.safetensors")
    refused("adapter_model.safetensors", "sha256")
    shutil.rmtree(drunk)
    shutil.copytree(outside, drunk)
    # v2's label pointed at v1's folder: a request for v2 must not open v1
    db.execute(
        "UPDATE base_model_versions SET version_label = '../releases/nimmerworld-base-v1' "
        "WHERE version_number = 2"
    )
    refused("nimmerworld-base-v2", "registry was edited")
    db.execute(
        "UPDATE base_model_versions SET version_label = 'nimmerworld-base-v2' WHERE version_number = 2"
    )
    # v1's folder moved into v2's place, v2's row given v1's manifest hash: the signed label differs
    (v1_sha,) = db.execute(
        "SELECT manifest_sha256 FROM base_model_versions WHERE version_number = 1"
    ).fetchone()
    db.execute("UPDATE base_model_versions SET manifest_sha256 = ? WHERE version_number = 2", (v1_sha,))
    (releases / "nimmerworld-base-v2").rename(tmp_path / "v2-aside")
    shutil.copytree(releases / "nimmerworld-base-v1", releases / "nimmerworld-base-v2")
    refused("version_label", "nimmerworld-base-v1", "another version")
    assert v1_id != v2_id
    db.close()


# 6. the bytes loaded are the bytes verified; symlinks refused


@pytest.mark.slow
def test_a_swap_after_verification_is_never_loaded(
    releases: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    verified = open_version(releases, "v1", _keyring(tmp_path))
    weights = releases / "nimmerworld-base-v1" / "model.safetensors"
    pristine = weights.read_bytes()
    _flip(weights)  # swapped after open_version passed
    with pytest.raises(IntegrityError, match="model.safetensors changed after verification"):
        load_model(verified)
    weights.write_bytes(pristine)
    ids = torch.tensor([[5, 6, 7, 8]])
    reference, _ = load_verified(verified)
    # swapped in the middle of loading (after the private copy was made): the copy is what loads
    real_load = versions._load

    def swap_then_load(version: versions.VerifiedVersion, *args: object) -> object:
        assert version.folder != verified.folder and oct(version.folder.parent.stat().st_mode)[-3:] == "700"
        _flip(weights)
        return real_load(version, *args)

    monkeypatch.setattr(versions, "_load", swap_then_load)
    loaded, tokenizer = load_verified(verified)
    assert weights.read_bytes() != pristine
    with torch.no_grad(), reference.disable_adapter(), loaded.disable_adapter():
        assert torch.equal(reference(input_ids=ids).logits, loaded(input_ids=ids).logits)
    assert tokenizer("Speak.").input_ids


WEIGHTS = bytes(range(256)) * 64  # 16 KiB


def _verified(tmp_path: Path) -> VerifiedVersion:
    """A version as open_version returns it, its one file as signed (the copy needs no more)."""
    folder = tmp_path / "releases" / "nimmerworld-base-v1"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    row = {"path": "model.safetensors", "sha256": hashlib.sha256(WEIGHTS).hexdigest(), "size": len(WEIGHTS)}
    manifest = {"blob_distribution": {"files": [row]}}
    return VerifiedVersion("nimmerworld-base-v1", folder, manifest, {})


def test_the_copy_never_reads_past_the_signed_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After verification the weights are swapped for a 16 GiB sparse file (no disk space on the
    release side): the private copy read and wrote all of it before comparing the size, filling
    the disk under the loader's temporary folder."""
    version = _verified(tmp_path)
    weights = version.folder / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(2**34)
    written = [0]
    real_open = open

    class Counting:
        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def write(self, data: bytes) -> int:
            written[0] += len(data)
            assert written[0] <= len(WEIGHTS) + 2**20, "the copy kept writing past the signed size"
            return self.fh.write(data)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(path, mode, *args, **kwargs)
        return Counting(fh) if "w" in mode else fh

    monkeypatch.setattr(versions, "open", counting_open, raising=False)
    with (
        pytest.raises(IntegrityError, match="model.safetensors changed after verification"),
        verified_copy(version),
    ):
        pass
    assert written[0] <= len(WEIGHTS) + 1


def test_a_file_swapped_for_a_fifo_fails_instead_of_hanging(tmp_path: Path) -> None:
    """A named pipe in place of a verified file: ``os.open`` blocked until some writer came,
    so the loader hung (O_NOFOLLOW does not refuse a FIFO)."""
    version = _verified(tmp_path)
    weights = version.folder / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    outcome: list[BaseException | None] = []

    def copy() -> None:
        try:
            with verified_copy(version):
                outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=copy, daemon=True)
    worker.start()
    worker.join(timeout=10)
    hung = worker.is_alive()
    if hung:  # release the blocked open() so the thread ends
        fd = os.open(weights, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(timeout=10)
    assert not hung, "verified_copy blocked opening a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], IntegrityError), outcome
    assert "not a regular file" in str(outcome[0])


@pytest.mark.slow
def test_symlinks_are_refused(releases: Path, tmp_path: Path) -> None:
    keys = _keyring(tmp_path)
    folder = releases / "nimmerworld-base-v1"
    # a file swapped for a symlink to identical bytes outside the release
    outside = tmp_path / "outside.json"
    shutil.copy(folder / "config.json", outside)
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(outside)
    with pytest.raises(IntegrityError, match="config.json .*symlink"):
        open_version(releases, "v1", keys)
    (folder / "config.json").unlink()
    shutil.copy(outside, folder / "config.json")
    # a symlinked folder inside a LoRA (its files escaped the extra-files check)
    drunk = _lora(releases, "drunk-scavenger", 1)
    (tmp_path / "payload").mkdir()
    (tmp_path / "payload" / "evil.py").write_text("print('pwned')")
    (drunk / "extras").symlink_to(tmp_path / "payload", target_is_directory=True)
    with pytest.raises(IntegrityError, match="extras .*symlink"):
        open_version(releases, "v1", keys)
    (drunk / "extras").unlink()
    # the whole version folder a symlink to a copy
    shutil.move(folder, tmp_path / "v1-real")
    folder.symlink_to(tmp_path / "v1-real", target_is_directory=True)
    with pytest.raises(IntegrityError, match="symlink"):
        open_version(releases, "v1", keys)


# 7. key handling


def test_no_command_overwrites_a_private_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trusted = tmp_path / "trusted"
    assert cli.main(["keys", "generate", str(tmp_path / "x.pub")]) == 1
    assert "may not end in .pub" in capsys.readouterr().err and not (tmp_path / "x.pub").exists()
    private = tmp_path / "publisher.key"
    assert cli.main(["keys", "generate", str(private), "--trust", str(trusted)]) == 0
    pem = private.read_bytes()
    # a private key where the public half would go: refused, never overwritten
    shutil.copy(private, tmp_path / "other.pub")
    assert cli.main(["keys", "generate", str(tmp_path / "other.key")]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "other.pub").read_bytes() == pem and not (tmp_path / "other.key").exists()
    assert cli.main(["keys", "generate", str(private)]) == 1
    # trusting a key whose trusted name is taken by another file leaves that file alone
    kid = generate_key(tmp_path / "second.key")
    squatted = trusted / f"{kid}.pub"
    squatted.write_bytes(pem)
    assert cli.main(["keys", "trust", str(tmp_path / "second.pub"), str(trusted)]) == 1
    assert squatted.read_bytes() == pem and private.read_bytes() == pem
    assert cli.main(["keys", "trust", str(private.with_suffix(".pub")), str(trusted)]) == 0  # idempotent


def test_a_private_key_readable_by_others_is_refused(tmp_path: Path) -> None:
    private = tmp_path / "publisher.key"
    generate_key(private)
    load_private(private)
    os.chmod(private, 0o644)
    with pytest.raises(NimmerError, match=r"permissions 0o644.*chmod 600"):
        load_private(private)
    private.write_text("not a key")
    os.chmod(private, 0o600)
    with pytest.raises(NimmerError, match="not an unencrypted PEM private key"):
        load_private(private)


@pytest.mark.parametrize(
    "signature",
    [
        [],
        "ed25519",
        None,
        {"algorithm": "ed25519"},
        {"algorithm": "ed25519", "key_id": ["x"], "signature": "AAAA"},
        {"algorithm": "ed25519", "key_id": "k", "signature": 5},
    ],
)
def test_malformed_signatures_get_a_clear_error(tmp_path: Path, signature: object) -> None:
    private = tmp_path / "k.key"
    generate_key(private, tmp_path / "trusted")
    keyring = Keyring.load(tmp_path / "trusted")
    with pytest.raises(SignatureError, match="malformed"):
        keyring.verify(b"{}", signature, "manifest.json")
    good = sign(b"{}", load_private(private))
    with pytest.raises(SignatureError, match="does not verify"):
        keyring.verify(b"{}", {**good, "signature": "not base64!"}, "manifest.json")


@pytest.mark.slow
def test_a_malformed_manifest_sig_in_a_release_fails_clearly(releases: Path, tmp_path: Path) -> None:
    (releases / "nimmerworld-base-v1" / SIGNATURE).write_text(json.dumps(["not", "a", "signature"]))
    with pytest.raises(SignatureError, match="malformed"):
        open_version(releases, "v1", _keyring(tmp_path))
    assert cli.main(["versions", "--releases", str(releases), "verify", "v1"]) == 1
