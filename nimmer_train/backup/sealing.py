"""Client-side encryption of a player's LoRA for cloud backup (the design's player_lora_backups):
the backup host only ever holds ciphertext.

Envelope encryption: a random 256-bit data key encrypts the LoRA with AES-256-GCM; the data key
is wrapped, also with AES-256-GCM, under a key derived by scrypt from the player's passphrase, and
again under each recovery code, so either unlocks the backup. A wrong passphrase or code, or any
changed byte, fails authentication.

The associated data (AAD) of every encryption binds the method, the metadata (backup account,
backup id, LoRA name and version, size), the KDF parameters and each wrap's kind, salt and nonce:
a host cannot swap one backup's envelope into another, relabel a version, or weaken the KDF
without unsealing failing. Before anything is derived, unsealing refuses KDF parameters outside
:data:`KDF_ALLOWED` (a module constant, never something a blob can set) and more wraps than
:data:`MAX_WRAPS`, so a planted blob cannot make a restore allocate or spend without bound.

Cost: scrypt n = 2**17, r = 8, p = 1 (128 MiB and about 0.5-1 s per derivation on one laptop
core; OWASP's floor for scrypt). Passphrases are checked with zxcvbn (a maintained strength
estimator) and must score at least :data:`MIN_PASSPHRASE_SCORE` of 4.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
import secrets
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt

from nimmer_train.errors import NimmerError

METHOD = "aes-256-gcm+scrypt-envelope-v2"
# The only KDF parameter sets a sealed blob may name; sealing uses the first. Tests may swap in a
# cheaper set by patching this constant; a blob can never widen it.
KDF_ALLOWED: tuple[dict[str, int], ...] = ({"n": 2**17, "r": 8, "p": 1},)
MAX_RECOVERY_CODES = 16
MAX_WRAPS = 1 + MAX_RECOVERY_CODES  # one passphrase wrap and the recovery codes
MIN_PASSPHRASE_SCORE = 3  # zxcvbn's 0-4 scale: 3 = "safely unguessable" (~10^10 guesses)
MAX_NAME_CHARS = 128
MAX_VERSION = 2**63 - 1  # SQLite's INTEGER
CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # no 0/O, 1/I
FIELDS = ("metadata", "nonce", "ciphertext", "wraps", "method", "kdf")
WRAP_FIELDS = ("kind", "salt", "nonce", "wrapped")
UUID_RE = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class BackupError(NimmerError):
    """A backup cannot be sealed or opened: weak or wrong secret, a malformed or changed blob."""


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BackupError(f"the backup blob's {what} is not base64") from exc


def _kek(secret: str, salt: bytes, params: dict[str, int]) -> bytes:
    return Scrypt(salt=salt, length=32, n=params["n"], r=params["r"], p=params["p"]).derive(secret.encode())


def check_metadata(meta: Any) -> dict[str, Any]:
    """The plain metadata of a sealed blob, or :class:`BackupError` naming the bad field."""
    if not isinstance(meta, dict):
        raise BackupError(f"metadata must be a JSON object, not {type(meta).__name__}")
    for key in ("account", "backup_id", "lora_name"):
        value = meta.get(key)
        if not isinstance(value, str) or not 0 < len(value) <= MAX_NAME_CHARS:
            raise BackupError(f"metadata.{key} must be a string of 1-{MAX_NAME_CHARS} characters")
        if not _utf8(value):
            raise BackupError(f"metadata.{key} is not valid Unicode text (a lone surrogate such as \\ud800)")
    if not UUID_RE.fullmatch(meta["backup_id"]):
        raise BackupError("metadata.backup_id must be a lowercase uuid4")
    for key, top in (("lora_version", MAX_VERSION), ("size_bytes", MAX_VERSION)):
        value = meta.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise BackupError(f"metadata.{key} must be an integer in [0, {top}], not {value!r}")
    return meta


def _utf8(text: str) -> bool:
    """JSON's ``"\\ud800"`` parses to a lone surrogate, which no store can encode (SQLite refuses to
    bind it): such a name must be a 400 at the door, not an error half-way through storing."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _exact_kdf(kdf: Any) -> bool:
    """KDF parameters are plain ints: ``{"n": 1024.0}`` or ``{"p": true}`` compare equal to an
    allowed set in Python but are not it (scrypt refuses a float; the AAD binds the JSON text)."""
    return isinstance(kdf, dict) and all(type(v) is int for v in kdf.values())


@dataclass(frozen=True)
class Sealed:
    """What leaves the device: ciphertext, wrapped keys and plain metadata, nothing else."""

    metadata: dict[str, Any]  # account, backup_id, lora_name, lora_version, size_bytes (authenticated)
    nonce: str
    ciphertext: str
    wraps: list[dict[str, str]] = field(default_factory=list)  # kind, salt, nonce, wrapped key
    method: str = METHOD
    kdf: dict[str, int] = field(default_factory=lambda: dict(KDF_ALLOWED[0]))

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, blob: bytes) -> Sealed:
        """Parse and check a blob's structure (field types, metadata, method, KDF, wrap count)."""
        try:
            data = json.loads(blob)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # deep nesting: RecursionError
            raise BackupError("the backup blob is not a sealed LoRA (corrupt or truncated)") from exc
        if not isinstance(data, dict) or sorted(data) != sorted(FIELDS):
            raise BackupError(
                f"the backup blob is not a sealed LoRA (expected the fields {', '.join(FIELDS)})"
            )
        sealed = cls(**data)
        sealed.check()
        return sealed

    def check(self) -> None:
        """Everything about the blob that can be checked without a secret; cheap, derives nothing."""
        check_metadata(self.metadata)
        if self.method != METHOD:
            raise BackupError(f"unknown backup method {self.method!r}; this client reads {METHOD}")
        if not _exact_kdf(self.kdf) or self.kdf not in KDF_ALLOWED:
            raise BackupError(f"KDF parameters {self.kdf!r} are not allowed; allowed: {list(KDF_ALLOWED)}")
        if not isinstance(self.nonce, str) or not isinstance(self.ciphertext, str):
            raise BackupError("nonce and ciphertext must be base64 strings")
        if not isinstance(self.wraps, list) or not 0 < len(self.wraps) <= MAX_WRAPS:
            raise BackupError(f"a sealed backup holds 1-{MAX_WRAPS} key wraps")
        for wrap in self.wraps:
            if not isinstance(wrap, dict) or sorted(wrap) != sorted(WRAP_FIELDS):
                raise BackupError(f"each key wrap has exactly the fields {', '.join(WRAP_FIELDS)}")
            if wrap["kind"] not in ("passphrase", "recovery") or not all(
                isinstance(wrap[k], str) for k in WRAP_FIELDS
            ):
                raise BackupError("a key wrap's kind is passphrase or recovery, its fields strings")
        if sum(w["kind"] == "passphrase" for w in self.wraps) > 1:
            raise BackupError("a sealed backup holds at most one passphrase wrap")
        if len(_unb64(self.ciphertext, "ciphertext")) != self.metadata["size_bytes"] + 16:
            raise BackupError("metadata.size_bytes does not match the ciphertext's length")

    def aad(self) -> bytes:
        headers = [{k: w[k] for k in ("kind", "salt", "nonce")} for w in self.wraps]
        return json.dumps(
            {"method": self.method, "metadata": self.metadata, "kdf": self.kdf, "wraps": headers},
            sort_keys=True,
        ).encode()


def recovery_code() -> str:
    """A 20-character code in groups of five, about 100 bits."""
    raw = "".join(secrets.choice(CODE_ALPHABET) for _ in range(20))
    return "-".join(raw[i : i + 5] for i in range(0, 20, 5))


def _normalise(code: str) -> str:
    return code.replace("-", "").replace(" ", "").upper()


def check_passphrase(passphrase: str, hints: list[str] | None = None) -> None:
    """Refuse a passphrase zxcvbn rates below :data:`MIN_PASSPHRASE_SCORE`, with its advice."""
    from zxcvbn import zxcvbn

    if len(passphrase) < 12:
        raise BackupError("the backup passphrase must have at least 12 characters (use a few words)")
    rating = zxcvbn(passphrase[:200], user_inputs=[h for h in hints or [] if h])
    if rating["score"] < MIN_PASSPHRASE_SCORE:
        advice = " ".join(filter(None, [rating["feedback"]["warning"], *rating["feedback"]["suggestions"]]))
        raise BackupError(
            f"the backup passphrase is too easy to guess (strength {rating['score']}/4, "
            f"needs {MIN_PASSPHRASE_SCORE}). {advice}".strip()
        )


def seal(
    data: bytes, passphrase: str, metadata: dict[str, Any], account: str, recovery_codes: int = 8
) -> tuple[Sealed, list[str]]:
    """Encrypt ``data`` on the device for backup account ``account`` (``metadata`` names the
    LoRA: lora_name, lora_version); returns the sealed backup, whose metadata carries a fresh
    backup_id, and the recovery codes to show the player once."""
    if not 0 <= recovery_codes <= MAX_RECOVERY_CODES:
        raise BackupError(f"recovery_codes must be 0-{MAX_RECOVERY_CODES}")
    check_passphrase(passphrase, [account, str(metadata.get("lora_name", ""))])
    meta = check_metadata(
        {**metadata, "account": account, "backup_id": str(uuid.uuid4()), "size_bytes": len(data)}
    )
    kdf = dict(KDF_ALLOWED[0])
    codes = [recovery_code() for _ in range(recovery_codes)]
    secrets_ = [("passphrase", passphrase)] + [("recovery", _normalise(c)) for c in codes]
    wraps = [
        {"kind": kind, "salt": _b64(os.urandom(16)), "nonce": _b64(os.urandom(12))} for kind, _ in secrets_
    ]
    data_key, nonce = AESGCM.generate_key(bit_length=256), os.urandom(12)
    aad = Sealed(meta, _b64(nonce), "", [{**w, "wrapped": ""} for w in wraps], METHOD, kdf).aad()
    ciphertext = AESGCM(data_key).encrypt(nonce, data, aad)
    for wrap, (_, secret) in zip(wraps, secrets_, strict=True):
        kek = _kek(secret, base64.b64decode(wrap["salt"]), kdf)
        wrap["wrapped"] = _b64(AESGCM(kek).encrypt(base64.b64decode(wrap["nonce"]), data_key, aad))
    return Sealed(meta, _b64(nonce), _b64(ciphertext), wraps, METHOD, kdf), codes


def unseal(
    sealed: Sealed,
    passphrase: str | None = None,
    recovery_code: str | None = None,
    expect: dict[str, Any] | None = None,
) -> bytes:
    """The LoRA bytes, with the passphrase or one recovery code. ``expect`` (e.g. account,
    backup_id, lora_name, lora_version) must match the blob's authenticated metadata: a host that
    answers with another backup, or an older version, is refused."""
    sealed.check()  # method, KDF whitelist and wrap cap before anything is derived
    if (passphrase is None) == (recovery_code is None):
        raise BackupError("give the passphrase or a recovery code")
    expect = expect or {}
    wrong = sorted(k for k, v in expect.items() if sealed.metadata.get(k) != v)
    if wrong:
        got = ", ".join(f"{k}={sealed.metadata.get(k)!r}" for k in wrong)
        asked = ", ".join(f"{k}={expect[k]!r}" for k in wrong)
        raise BackupError(
            f"the backup host returned a backup with {got}, not the one asked for ({asked}); "
            "refusing it (no rollback to another backup)"
        )
    kind, secret = (
        ("passphrase", passphrase)
        if passphrase is not None
        else ("recovery", _normalise(recovery_code or ""))
    )
    aad, data_key = sealed.aad(), None
    for wrap in (w for w in sealed.wraps if w["kind"] == kind):
        try:
            kek = _kek(secret or "", _unb64(wrap["salt"], "salt"), sealed.kdf)
            data_key = AESGCM(kek).decrypt(
                _unb64(wrap["nonce"], "nonce"), _unb64(wrap["wrapped"], "wrap"), aad
            )
            break
        except (InvalidTag, ValueError):
            continue
    if data_key is None:
        what = "passphrase" if kind == "passphrase" else "recovery code"
        raise BackupError(f"wrong {what} for this backup (or its key envelope was tampered with)")
    try:
        return AESGCM(data_key).decrypt(
            _unb64(sealed.nonce, "nonce"), _unb64(sealed.ciphertext, "ciphertext"), aad
        )
    except (InvalidTag, ValueError) as exc:
        raise BackupError("the backup's ciphertext was changed or is corrupt; nothing was restored") from exc
