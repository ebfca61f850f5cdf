"""The device key (``runtime.key``) seals the clasp store and the BYOK provider keys under HKDF,
which does not stretch: a key file cut short (0 bytes, left by a kill between creating and writing
it) once sealed everything under ``""``, so the sealed file alone opened. A key under 32
characters is now refused by name, with what to do, and nothing is sealed under it. Real files,
real AES-GCM and HKDF."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from nimmer_train.errors import NimmerError
from nimmer_train.memory import clasp
from nimmer_train.memory.clasp import CLASP_FILE, open_clasp
from nimmer_train.memory.llm_config import KEY_FILE, MIN_SECRET_CHARS, device_secret
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from tests.helpers.memory import Clock, HashEmbedder

SECRET = "Quillfeather hid the ferryman's ledger under the ninth stair"
SHORT_KEYS = [b"", b"\n", b"k" * (MIN_SECRET_CHARS - 1), b"\xff" * 64]  # cut short, stub, not text


def _key_file(folder: Path, content: bytes) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / KEY_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(content)
    return path


def _says_what_to_do(refused: pytest.ExceptionInfo[NimmerError], path: Path) -> None:
    message = str(refused.value)
    assert str(path) in message, message
    assert "move it aside" in message and "clasp.sealed" in message, message


@pytest.mark.parametrize("content", SHORT_KEYS, ids=["empty", "newline", "short", "binary"])
def test_a_short_runtime_key_is_refused_by_name(tmp_path: Path, content: bytes) -> None:
    path = _key_file(tmp_path / "player", content)
    with pytest.raises(NimmerError, match="not a device key") as refused:
        device_secret(path.parent)
    _says_what_to_do(refused, path)
    assert path.read_bytes() == content  # refused, never replaced behind the player's back


def test_an_in_between_line_is_never_sealed_under_an_empty_key(tmp_path: Path) -> None:
    """The attack: with a 0-byte key an in-between turn was sealed under HKDF(""), and anyone
    holding only clasp.sealed unsealed it. Now the write is refused and nothing is sealed."""
    folder = tmp_path / "player"
    path = _key_file(folder, b"")
    memory = PlayerMemory(folder, HashEmbedder(), clock=Clock())
    try:
        with pytest.raises(NimmerError, match="not a device key") as refused:
            memory.write(SECRET, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    finally:
        memory.close()
    _says_what_to_do(refused, path)
    assert not (folder / CLASP_FILE).exists()
    with pytest.raises(NimmerError, match="not a device key"):
        open_clasp(folder).close()
    # and the clasp's own key derivation takes no short secret, whoever passes it
    for short in ("", "k" * (MIN_SECRET_CHARS - 1)):
        with pytest.raises(NimmerError, match=f"at least {MIN_SECRET_CHARS}"):
            clasp._kek(short)


def test_a_full_runtime_key_still_seals_and_opens_the_clasp(tmp_path: Path) -> None:
    folder = tmp_path / "player"
    memory = PlayerMemory(folder, HashEmbedder(), clock=Clock())
    try:
        memory.write(SECRET, "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    finally:
        memory.close()
    assert len(device_secret(folder)) >= MIN_SECRET_CHARS
    store = open_clasp(folder)
    try:
        assert SECRET in str(store.execute("SELECT text FROM entries").fetchall())
    finally:
        store.close()
