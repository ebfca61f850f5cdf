"""Exploit tests from an adversarial review of the hardened backup host (issue 21, items 1-3):
each performs an attack that worked against the first hardening, on loopback against the real
service, and shows that it now fails."""

from __future__ import annotations

import base64
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nimmer_train.backup import service
from nimmer_train.backup.device import DeviceKey, account_id
from nimmer_train.backup.sealing import BackupError, Sealed, seal, unseal
from nimmer_train.backup.service import BackupClient, local_app
from tests.helpers.loopback import serve_app

PASSPHRASE = "correct horse battery staple"
LORA = bytes(range(256)) * 16


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return tmp_path / "host"


def _device(url: str) -> BackupClient:
    client = BackupClient(url, DeviceKey.generate())
    client.register()
    return client


def _nothing_stored(folder: Path) -> bool:
    return not any((folder / "blobs").iterdir())


@pytest.mark.parametrize("stamp", ["9" * 5000, "\xb2"])  # int() refuses both: over 4300 digits, "²"
def test_a_malformed_timestamp_is_a_counted_401_not_a_500(folder: Path, stamp: str) -> None:
    """Both passed ``str.isdigit`` and crashed ``int()``: an uncounted 500 with a traceback in the
    log per request, outside the failed-authentication limit."""
    with serve_app(local_app(folder, rate=(3, 60.0))) as url:
        victim = _device(url)
        path = f"/accounts/{victim.account}/backups"
        codes = []
        for _ in range(4):
            headers = victim.device.headers("GET", path, "", b"")
            headers["X-Nimmer-Timestamp"] = stamp
            raw = {k: v.encode("latin-1") for k, v in headers.items()}
            codes.append(httpx.get(url + path, headers=raw).status_code)
        assert codes == [401, 401, 401, 429]


def test_deeply_nested_json_is_a_400_not_a_500(folder: Path) -> None:
    """``json.loads`` raises RecursionError (not ValueError) on deep nesting: the unauthenticated
    registration endpoint and a signed upload both answered 500."""
    deep = b"[" * 100_000 + b"]" * 100_000
    with serve_app(local_app(folder)) as url:
        registration = httpx.post(f"{url}/accounts", content=deep)
        assert registration.status_code == 400, registration.text
        victim = _device(url)
        path = f"/accounts/{victim.account}/backups"
        for body in (deep, b'{"metadata": ' + deep + b"}"):
            response = victim.http.put(path, content=body)
            assert response.status_code == 400, response.text
        assert _nothing_stored(folder) and victim.list() == []


@pytest.mark.parametrize(
    "kdf",
    [
        {"n": 2**10 * 1.0, "r": 8, "p": 1},  # == the allowed set in Python, a float to scrypt
        {"n": 2**10, "r": 8, "p": True},  # True == 1
        {"n": 2**10, "r": 8.0, "p": 1},
    ],
)
def test_kdf_whitelist_is_not_bypassed_by_equal_values_of_other_types(folder: Path, kdf: dict) -> None:
    """``{"n": 1024.0} == {"n": 1024}``: a float or bool passed the whitelist; the host stored the
    blob and the client's restore crashed with a TypeError inside scrypt instead of refusing."""
    with serve_app(local_app(folder)) as url:
        victim = _device(url)
        sealed, _ = seal(LORA, PASSPHRASE, {"lora_name": "voice", "lora_version": 1}, victim.account, 0)
        data = json.loads(sealed.to_bytes())
        data["kdf"] = kdf
        planted = json.dumps(data).encode()
        response = victim.http.put(f"/accounts/{victim.account}/backups", content=planted)
        assert response.status_code == 400 and "not allowed" in response.text, response.text
        assert _nothing_stored(folder)
    forged = Sealed(**data)
    with pytest.raises(BackupError, match="KDF parameters .* are not allowed"):
        unseal(forged, passphrase=PASSPHRASE)


def test_registering_more_accounts_does_not_multiply_the_rate_limit(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accounts are free to register and each had its own request budget, so one address with
    many device keys was not limited at all. Every request from one address now counts too."""
    monkeypatch.setattr(service, "ADDRESS_RATE_LIMIT", (8, 60.0), raising=False)
    with serve_app(local_app(folder, rate=(5, 60.0))) as url:
        codes = []
        for _ in range(3):
            device = _device(url)  # three fresh accounts from the one address
            codes += [device.http.get(f"/accounts/{device.account}/backups").status_code for _ in range(5)]
        assert codes.count(200) == 8 and set(codes[8:]) == {429}


class RecordingLimiter(service.RateLimiter):
    made: list[service.RateLimiter] = []
    keys: set[str] = set()  # every key ever counted

    def __init__(self, limit: int, window_s: float) -> None:
        super().__init__(limit, window_s)
        RecordingLimiter.made.append(self)

    def allow(self, key: str) -> bool:
        RecordingLimiter.keys.add(key)
        return super().allow(key)


@pytest.fixture
def limiters(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[service.RateLimiter]]:
    RecordingLimiter.made, RecordingLimiter.keys = [], set()
    monkeypatch.setattr(service, "RateLimiter", RecordingLimiter)
    yield RecordingLimiter.made


def test_the_rate_limiter_forgets_idle_addresses(folder: Path, limiters: list) -> None:
    """Every address that ever sent a request kept an entry in the limiter for the life of the
    process (even a request that was only checked, never counted): memory grew with each new
    source address. Entries now go once their window has passed."""
    with serve_app(local_app(folder, rate=(100, 0.5))) as url:
        for last in range(2, 42):  # forty source addresses on loopback, each failing once
            with httpx.Client(transport=httpx.HTTPTransport(local_address=f"127.0.0.{last}")) as client:
                assert client.get(f"{url}/accounts/x/backups").status_code == 401
        assert len({k for k in RecordingLimiter.keys if k.startswith("addr:127.0.0.")}) == 40
        time.sleep(1.1)  # two windows
        assert httpx.get(f"{url}/accounts/x/backups").status_code == 401
        assert sum(len(limiter.hits) for limiter in limiters) <= 2


P = 2**255 - 19
Y8 = 2707385501144840649318225287225658788936804267575313519463743609750303402022  # an order-8 point
# every point of order 1, 2, 4 or 8 (y = 1, -1, 0, +-Y8) with either sign of x, and the
# non-canonical encoding p + 1 of the identity
SMALL_ORDER = [
    (y | sign << 255).to_bytes(32, "little") for y in (1, P - 1, 0, Y8, P - Y8) for sign in (0, 1)
] + [(P + 1).to_bytes(32, "little")]


def test_a_small_order_device_key_cannot_be_registered(folder: Path) -> None:
    """Ed25519 as OpenSSL verifies it accepts, for the identity point as public key, the signature
    (R = identity, S = 0) on every message. Registering that key made an account that anyone
    could sign for, without any private key; the same for every point of small order."""
    identity = SMALL_ORDER[0]
    forged_signature = base64.b64encode(identity + bytes(32)).decode()
    with serve_app(local_app(folder, rate=(100, 60.0))) as url:
        response = httpx.post(f"{url}/accounts", json={"public_key": base64.b64encode(identity).decode()})
        assert response.status_code == 400 and "small order" in response.text, response.text
        account = account_id(identity)
        path = f"/accounts/{account}/backups"
        headers = {  # no private key anywhere: the "signature" is a constant
            "X-Nimmer-Account": account,
            "X-Nimmer-Timestamp": str(int(time.time())),
            "X-Nimmer-Nonce": secrets.token_hex(16),
            "X-Nimmer-Signature": forged_signature,
        }
        assert httpx.get(url + path, headers=headers).status_code == 401
        for key in SMALL_ORDER[1:]:
            response = httpx.post(f"{url}/accounts", json={"public_key": base64.b64encode(key).decode()})
            assert response.status_code == 400, key.hex()
        assert _device(url).list() == []  # an ordinary key still registers
