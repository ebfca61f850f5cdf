"""The device's identity towards the backup host: an Ed25519 device key, the backup account id
derived from it, and signed requests.

The account id is ``acct-`` + the first 32 hex digits of the public key's sha256, so an account
cannot be claimed by anyone but the holder of its key (registering a key creates the account; a
key of small order, for which signatures can be forged without any private key, is refused).
Every request carries four headers: the account, a Unix timestamp, a random nonce and an Ed25519
signature over :func:`signed_message` (method, path, query, the body's sha256, timestamp, nonce,
account). The host accepts a timestamp within :data:`MAX_SKEW_S` of its clock and each nonce once.
"""

from __future__ import annotations

import base64
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from nimmer_train.artifacts import write_secret
from nimmer_train.backup.sealing import BackupError

ACCOUNT_HEADER = "X-Nimmer-Account"
TIMESTAMP_HEADER = "X-Nimmer-Timestamp"
NONCE_HEADER = "X-Nimmer-Nonce"
SIGNATURE_HEADER = "X-Nimmer-Signature"
MAX_SKEW_S = 300  # a signed request is good for five minutes either side of the host's clock


_P = 2**255 - 19
# the y-coordinates of the Ed25519 points of order 1, 2, 4 and 8 (identity, -1, 0, +-Y8)
_SMALL_ORDER_Y = frozenset(
    {1, _P - 1, 0, 2707385501144840649318225287225658788936804267575313519463743609750303402022}
    | {_P - 2707385501144840649318225287225658788936804267575313519463743609750303402022}
)


def small_order(public_raw: bytes) -> bool:
    """True for a public key on a point of small order (in any encoding): OpenSSL's Ed25519 then
    accepts signatures nobody made (for the identity, (R = identity, S = 0) on every message), so
    such a key would give an account that anyone can sign for."""
    y = int.from_bytes(public_raw, "little") & ((1 << 255) - 1)
    return y % _P in _SMALL_ORDER_Y


def account_id(public_raw: bytes) -> str:
    """The backup account of a device public key (raw 32 bytes)."""
    return "acct-" + hashlib.sha256(public_raw).hexdigest()[:32]


def signed_message(
    method: str, path: str, query: str, body: bytes, timestamp: str, nonce: str, account: str
) -> bytes:
    digest = hashlib.sha256(body).hexdigest()
    return "\n".join(
        ["nimmer-backup-request-v1", method.upper(), path, query, digest, timestamp, nonce, account]
    ).encode()


@dataclass(frozen=True)
class DeviceKey:
    """The device's Ed25519 key; its public half is registered with the backup host once."""

    private: Ed25519PrivateKey

    @classmethod
    def generate(cls) -> DeviceKey:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def load(cls, path: Path) -> DeviceKey:
        mode = path.stat().st_mode
        if os.name == "posix" and mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise BackupError(
                f"device key {path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it"
            )
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        if not isinstance(key, Ed25519PrivateKey):
            raise BackupError(f"{path} is not an Ed25519 private key")
        return cls(key)

    def save(self, path: Path) -> None:
        """Write the key (mode 0600), refusing to overwrite an existing file."""
        pem = self.private.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        write_secret(path, pem)

    @property
    def public_raw(self) -> bytes:
        return self.private.public_key().public_bytes(
            serialization.Encoding.Raw, serialization.PublicFormat.Raw
        )

    @property
    def account(self) -> str:
        return account_id(self.public_raw)

    def headers(self, method: str, path: str, query: str, body: bytes) -> dict[str, str]:
        timestamp, nonce = str(int(time.time())), secrets.token_hex(16)
        message = signed_message(method, path, query, body, timestamp, nonce, self.account)
        return {
            ACCOUNT_HEADER: self.account,
            TIMESTAMP_HEADER: timestamp,
            NONCE_HEADER: nonce,
            SIGNATURE_HEADER: base64.b64encode(self.private.sign(message)).decode(),
        }


class DeviceAuth(httpx.Auth):
    """Signs every request an ``httpx`` client sends with the device key."""

    requires_request_body = True

    def __init__(self, key: DeviceKey) -> None:
        self.key = key

    def auth_flow(self, request: httpx.Request) -> Iterator[httpx.Request]:
        request.headers.update(
            self.key.headers(request.method, request.url.path, request.url.query.decode(), request.content)
        )
        yield request
