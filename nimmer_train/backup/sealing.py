"""Client-side encryption of a player's LoRA for cloud backup (the design's player_lora_backups):
the backup host only ever holds ciphertext.

Envelope encryption: a random 256-bit data key encrypts the LoRA with AES-256-GCM (the metadata
is authenticated as associated data); the data key is wrapped, also with AES-256-GCM, under a key
derived by scrypt from the player's passphrase, and again under each recovery code, so either
unlocks the backup. A wrong passphrase or code, or any changed byte, fails authentication.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from nimmer_train.errors import NimmerError

METHOD = "aes-256-gcm+scrypt-envelope-v1"
SCRYPT = {"n": 2**15, "r": 8, "p": 1}  # ~0.1 s per derivation on a laptop core
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I


class BackupError(NimmerError):
    """A backup cannot be opened: wrong secret, or the blob was changed."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _kek(secret: str, salt: bytes, params: dict[str, int]) -> bytes:
    return Scrypt(salt=salt, length=32, **params).derive(secret.encode())


@dataclass(frozen=True)
class Sealed:
    """What leaves the device: ciphertext, wrapped keys and plain metadata, nothing else."""

    metadata: dict[str, Any]  # lora_name, lora_version, size_bytes, ... (authenticated, not secret)
    nonce: str
    ciphertext: str
    wraps: list[dict[str, str]] = field(default_factory=list)  # kind, salt, nonce, wrapped key
    method: str = METHOD
    kdf: dict[str, int] = field(default_factory=lambda: dict(SCRYPT))

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Sealed:
        try:
            data = json.loads(blob)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise BackupError("the backup blob is not a sealed LoRA (corrupt or truncated)") from exc

    def aad(self) -> bytes:
        return json.dumps({"method": self.method, "metadata": self.metadata}, sort_keys=True).encode()


def recovery_code() -> str:
    """A 20-character code in groups of five, about 100 bits."""
    raw = "".join(secrets.choice(CODE_ALPHABET) for _ in range(20))
    return "-".join(raw[i : i + 5] for i in range(0, 20, 5))


def _normalise(code: str) -> str:
    return code.replace("-", "").replace(" ", "").upper()


def seal(
    data: bytes, passphrase: str, metadata: dict[str, Any], recovery_codes: int = 8
) -> tuple[Sealed, list[str]]:
    """Encrypt ``data`` on the device; returns the sealed backup and the recovery codes to show
    the player once."""
    if len(passphrase) < 8:
        raise BackupError("the backup passphrase must have at least 8 characters")
    data_key, nonce = AESGCM.generate_key(bit_length=256), os.urandom(12)
    codes = [recovery_code() for _ in range(recovery_codes)]
    meta = {**metadata, "size_bytes": len(data)}
    shell = Sealed(meta, _b64(nonce), "")
    ciphertext = AESGCM(data_key).encrypt(nonce, data, shell.aad())
    wraps = []
    for kind, secret in [("passphrase", passphrase)] + [("recovery", _normalise(c)) for c in codes]:
        salt, wrap_nonce = os.urandom(16), os.urandom(12)
        wrapped = AESGCM(_kek(secret, salt, SCRYPT)).encrypt(wrap_nonce, data_key, shell.aad())
        wraps.append({"kind": kind, "salt": _b64(salt), "nonce": _b64(wrap_nonce), "wrapped": _b64(wrapped)})
    return Sealed(meta, _b64(nonce), _b64(ciphertext), wraps), codes


def unseal(sealed: Sealed, passphrase: str | None = None, recovery_code: str | None = None) -> bytes:
    """The LoRA bytes, with the passphrase or one recovery code."""
    if sealed.method != METHOD:
        raise BackupError(f"unknown backup method {sealed.method!r}; this client reads {METHOD}")
    if (passphrase is None) == (recovery_code is None):
        raise BackupError("give the passphrase or a recovery code")
    kind, secret = (
        ("passphrase", passphrase)
        if passphrase is not None
        else ("recovery", _normalise(recovery_code or ""))
    )
    data_key = None
    for wrap in (w for w in sealed.wraps if w["kind"] == kind):
        try:
            kek = _kek(secret, _unb64(wrap["salt"]), sealed.kdf)
            data_key = AESGCM(kek).decrypt(_unb64(wrap["nonce"]), _unb64(wrap["wrapped"]), sealed.aad())
            break
        except InvalidTag:
            continue
    if data_key is None:
        what = "passphrase" if kind == "passphrase" else "recovery code"
        raise BackupError(f"wrong {what} for this backup (or its key envelope was tampered with)")
    try:
        return AESGCM(data_key).decrypt(_unb64(sealed.nonce), _unb64(sealed.ciphertext), sealed.aad())
    except InvalidTag as exc:
        raise BackupError("the backup's ciphertext was changed or is corrupt; nothing was restored") from exc
