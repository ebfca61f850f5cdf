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
from dataclasses import dataclass
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

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
    """Write a new private key (refusing to overwrite one) and, if given, trust its public half;
    return its key id."""
    if private_path.exists():
        raise NimmerError(f"{private_path} already exists; move it away to rotate, never overwrite a key")
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)
    kid = key_id(key.public_key())
    pub = private_path.with_suffix(PUBLIC_SUFFIX)
    pub.write_text(public_text(key.public_key()))
    if trusted_dir is not None:
        trust(pub, trusted_dir)
    return kid


def trust(public_file: Path, trusted_dir: Path) -> str:
    """Copy a public key into the trusted folder as ``<key_id>.pub``."""
    public = _read_public(public_file)
    kid = key_id(public)
    trusted_dir.mkdir(parents=True, exist_ok=True)
    (trusted_dir / f"{kid}{PUBLIC_SUFFIX}").write_text(public_text(public))
    return kid


def _read_public(path: Path) -> Ed25519PublicKey:
    try:
        return Ed25519PublicKey.from_public_bytes(base64.b64decode(path.read_text().strip()))
    except (ValueError, OSError) as exc:
        raise SignatureError(f"{path} is not an Ed25519 public key (base64 of 32 bytes): {exc}") from exc


def load_private(path: Path) -> Ed25519PrivateKey:
    if not path.exists():
        raise NimmerError(
            f"no signing key at {path}: create one with `nimmer keys generate {path}` "
            "(or set publish.signing_key)"
        )
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
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

    def verify(self, manifest_bytes: bytes, signature: dict, what: str) -> str:
        """Check ``signature`` (as written by :func:`sign`) over ``manifest_bytes``; return the key id."""
        kid = signature.get("key_id", "?")
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
            public.verify(base64.b64decode(signature["signature"]), manifest_bytes)
        except (InvalidSignature, KeyError, ValueError) as exc:
            raise SignatureError(
                f"{what}: the signature does not verify against trusted key {kid}; the manifest was "
                "changed after signing"
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
