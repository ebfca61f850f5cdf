"""Ed25519 keys for signing version manifests, and the keyring a loader trusts.

The publisher's private key is a PEM file (mode 0600) that never enters a release or the
repository; each public key lives as ``<key_id>.pub`` (raw 32 bytes, base64) in a trusted-keys
folder that ships with the runtime config. ``key_id`` is the first 16 hex digits of the public
key's sha256. Rotation: generate a new key, add its ``.pub`` to the trusted folder everywhere,
sign new versions with it; versions signed by the old key stay loadable until its ``.pub`` is
removed, after which loading them fails naming the old key.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from nimmer_train.artifacts import NOFOLLOW, write_secret
from nimmer_train.errors import NimmerError

ALGORITHM = "ed25519"
PUBLIC_SUFFIX = ".pub"  # a public key file: beside its private key, or <key_id>.pub when trusted


class SignatureError(NimmerError):
    """A manifest whose signature is missing, made by an untrusted key, or does not verify."""


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def public_text(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return base64.b64encode(raw).decode() + "\n"


def generate_key(private_path: Path, trusted_dir: Path | None = None) -> str:
    """Write a new private key and its public half beside it (refusing to overwrite either, and a
    private path that ends in .pub, whose public half would land on it) and, if given, trust the
    public half; return its key id."""
    pub = private_path.with_suffix(PUBLIC_SUFFIX)
    if private_path.suffix == PUBLIC_SUFFIX:
        raise NimmerError(
            f"{private_path}: a private key's name may not end in {PUBLIC_SUFFIX} (its public half is "
            f"written beside it as NAME{PUBLIC_SUFFIX}); use e.g. {private_path.with_suffix('.key')}"
        )
    for path in (private_path, pub):
        if path.exists() or path.is_symlink():
            raise NimmerError(f"{path} already exists; move it away to rotate, never overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    write_secret(private_path, pem)
    kid = key_id(key.public_key())
    _write_new(pub, public_text(key.public_key()))
    if trusted_dir is not None:
        trust(pub, trusted_dir)
    return kid


def trust(public_file: Path, trusted_dir: Path) -> str:
    """Copy a public key into the trusted folder as ``<key_id>.pub`` (a no-op if it is there;
    any other file of that name is never overwritten)."""
    public = _read_public(public_file)
    kid = key_id(public)
    trusted_dir.mkdir(parents=True, exist_ok=True)
    target = trusted_dir / f"{kid}{PUBLIC_SUFFIX}"
    if target.exists() or target.is_symlink():
        if not target.is_symlink() and target.read_bytes() == public_text(public).encode():
            return kid
        raise NimmerError(f"{target} already exists and is not this public key; refusing to overwrite it")
    _write_new(target, public_text(public))
    return kid


def _write_new(path: Path, text: str) -> None:
    """Create ``path`` (never overwriting, never through a symlink) with ``text``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o644)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def _read_public(path: Path) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(path.read_text().strip(), validate=True))
    except (ValueError, OSError) as exc:
        raise SignatureError(f"{path} is not an Ed25519 public key (base64 of 32 bytes): {exc}") from exc


def load_private(path: Path) -> Ed25519PrivateKey:
    if not path.exists():
        raise NimmerError(
            f"no signing key at {path}: create one with `nimmer keys generate {path}` "
            "(or set publish.signing_key)"
        )
    mode = path.stat().st_mode
    if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise NimmerError(
            f"signing key {path} has permissions {oct(mode & 0o777)}: others can read it; "
            f"`chmod 600 {path}` (and consider it leaked: rotate if others had access)"
        )
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (ValueError, TypeError) as exc:
        raise NimmerError(f"{path} is not an unencrypted PEM private key ({exc})") from exc
    if not isinstance(key, Ed25519PrivateKey):
        raise NimmerError(f"{path} is not an Ed25519 private key")
    return key


@dataclass(frozen=True)
class Keyring:
    """The public keys a loader trusts, by key id."""

    keys: dict[str, Ed25519PublicKey]
    source: str

    @classmethod
    def load(cls, trusted_dir: Path) -> Keyring:
        keys = {}
        for path in sorted(trusted_dir.glob(f"*{PUBLIC_SUFFIX}")) if trusted_dir.is_dir() else []:
            public = _read_public(path)
            keys[key_id(public)] = public
        return cls(keys, str(trusted_dir))

    def verify(self, manifest_bytes: bytes, signature: Any, what: str) -> str:
        """Check ``signature`` (as written by :func:`sign`) over ``manifest_bytes``; return the key id."""
        fields = ("algorithm", "key_id", "signature")
        if not isinstance(signature, dict) or not all(isinstance(signature.get(k), str) for k in fields):
            raise SignatureError(
                f"{what}: the signature file is malformed: expected a JSON object with string fields "
                f"{', '.join(fields)}, got {type(signature).__name__}"
            )
        kid = signature["key_id"]
        if signature.get("algorithm") != ALGORITHM:
            raise SignatureError(f"{what}: unsupported signature algorithm {signature.get('algorithm')!r}")
        public = self.keys.get(kid)
        if public is None:
            known = ", ".join(self.keys) or "none"
            raise SignatureError(
                f"{what} is signed by key {kid}, which is not a trusted publisher key "
                f"(trusted in {self.source}: {known})"
            )
        try:
            public.verify(base64.b64decode(signature["signature"], validate=True), manifest_bytes)
        except (InvalidSignature, ValueError) as exc:
            raise SignatureError(
                f"{what}: the signature does not verify against trusted key {kid}; it was changed "
                "after signing"
            ) from exc
        return kid


def sign(manifest_bytes: bytes, key: Ed25519PrivateKey) -> dict[str, str]:
    return {
        "algorithm": ALGORITHM,
        "key_id": key_id(key.public_key()),
        "signature": base64.b64encode(key.sign(manifest_bytes)).decode(),
    }


def signature_bytes(signature: dict[str, str]) -> bytes:
    return (json.dumps(signature, indent=2, sort_keys=True) + "\n").encode()
