"""Exploit tests for the LoRA backup host and sealing (issue 21, items 1-4): each performs the
attack a review reproduced against the real service on loopback (real SQLite, real blob files),
including those that worked against the first hardening, and shows that it now fails."""

from __future__ import annotations

import base64
import dataclasses
import json
import secrets
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nimmer_train.backup import sealing, service
from nimmer_train.backup.device import DeviceKey, account_id
from nimmer_train.backup.sealing import BackupError, Sealed, seal, unseal
from nimmer_train.backup.service import BackupClient, local_app
from nimmer_train.backup.storage import LocalBlobs
from tests.helpers.loopback import serve_app
from tests.unit.backup.conftest import PRODUCTION_KDF

PASSPHRASE = "correct horse battery staple"
LORA = bytes(range(256)) * 64


@dataclasses.dataclass
class Host:
    url: str
    folder: Path

    def device(self) -> BackupClient:
        return _device(self.url)

    def blobs(self) -> list[str]:
        return sorted(p.name for p in (self.folder / "blobs").iterdir())

    def rows(self) -> list[tuple]:
        db = sqlite3.connect(self.folder / "backups.sqlite")
        try:
            return db.execute(
                "SELECT backup_id, backup_account_id, lora_version FROM player_lora_backups"
            ).fetchall()
        finally:
            db.close()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    with serve_app(local_app(tmp_path / "host")) as url:
        yield Host(url, tmp_path / "host")


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The host's files, for tests that start the service with their own limits."""
    return tmp_path / "host"


def _device(url: str) -> BackupClient:
    client = BackupClient(url, DeviceKey.generate())
    client.register()
    return client


def _nothing_stored(folder: Path) -> bool:
    return not any((folder / "blobs").iterdir())


def _sealed(client: BackupClient, version: int, name: str = "voice") -> Sealed:
    return seal(LORA, PASSPHRASE, {"lora_name": name, "lora_version": version}, client.account, 2)[0]


def _forged(sealed: Sealed, **changes: object) -> bytes:
    data = json.loads(sealed.to_bytes())
    for key, value in changes.items():
        if key.startswith("meta_"):
            data["metadata"][key[5:]] = value
        else:
            data[key] = value
    return json.dumps(data).encode()


# 1. authentication, ownership, planting, replay, rate limit


def test_knowing_an_account_id_no_longer_lists_downloads_or_plants(host: Host) -> None:
    victim, attacker = host.device(), host.device()
    v1 = victim.upload(_sealed(victim, 1))
    # unsigned: list, download and upload by account id alone
    for method, path in (
        ("GET", f"/accounts/{victim.account}/backups"),
        ("GET", f"/backups/{v1}"),
        ("PUT", f"/accounts/{victim.account}/backups"),
    ):
        response = httpx.request(method, host.url + path, content=_sealed(victim, 9).to_bytes())
        assert response.status_code == 401, (method, path, response.text)
    # signed by another registered device: the victim's list is 403, the victim's blob 404
    assert attacker.http.get(f"/accounts/{victim.account}/backups").status_code == 403
    assert attacker.http.get(f"/backups/{v1}").status_code == 404
    with pytest.raises(BackupError, match="404"):
        attacker.download(v1)
    # planting a v2 in the victim's account: into the victim's path (403), or into the
    # attacker's own account with the victim's account in the blob (400)
    planted = _sealed(victim, 2)
    assert (
        attacker.http.put(f"/accounts/{victim.account}/backups", content=planted.to_bytes()).status_code
        == 403
    )
    response = attacker.http.put(f"/accounts/{attacker.account}/backups", content=planted.to_bytes())
    assert response.status_code == 400 and "another backup account" in response.text
    # a request claiming the victim's account but signed with the attacker's key
    forged = attacker.device.headers("GET", f"/accounts/{victim.account}/backups", "", b"")
    forged["X-Nimmer-Account"] = victim.account
    assert httpx.get(f"{host.url}/accounts/{victim.account}/backups", headers=forged).status_code == 401
    # nothing was planted: the victim's own v2 goes in, and only the victim sees it
    victim.upload(_sealed(victim, 2))
    assert [r["lora_version"] for r in victim.list()] == [1, 2]
    assert attacker.list() == []
    assert {row[1] for row in host.rows()} == {victim.account}


def test_signed_requests_cannot_be_replayed_or_kept(host: Host) -> None:
    victim = host.device()
    path = f"/accounts/{victim.account}/backups"
    body = _sealed(victim, 1).to_bytes()
    headers = victim.device.headers("PUT", path, "", body)
    assert httpx.put(host.url + path, content=body, headers=headers).status_code == 200
    replay = httpx.put(host.url + path, content=body, headers=headers)
    assert replay.status_code == 401 and "already used" in replay.text
    stale = victim.device.headers("GET", path, "", b"")
    stale["X-Nimmer-Timestamp"] = str(int(time.time()) - 3600)  # the signature no longer covers it
    assert httpx.get(host.url + path, headers=stale).status_code == 401
    # a signature over another body does not carry over to this one
    other = victim.device.headers("PUT", path, "", b"{}")
    assert httpx.put(host.url + path, content=body, headers=other).status_code == 401
    # registering an account id is not possible: ids are derived from the key
    response = httpx.post(f"{host.url}/accounts", json={"public_key": base64.b64encode(b"x" * 31).decode()})
    assert response.status_code == 400


def test_requests_are_rate_limited_per_account(tmp_path: Path) -> None:
    with serve_app(local_app(tmp_path / "host", rate=(5, 60.0))) as url:
        busy, quiet = (BackupClient(url, DeviceKey.generate()) for _ in range(2))
        busy.register(), quiet.register()
        codes = [busy.http.get(f"/accounts/{busy.account}/backups").status_code for _ in range(7)]
        assert codes == [200] * 5 + [429] * 2
        assert quiet.http.get(f"/accounts/{quiet.account}/backups").status_code == 200
        # an address that keeps failing authentication is limited too
        failures = [httpx.get(f"{url}/accounts/x/backups").status_code for _ in range(7)]
        assert failures[:5] == [401] * 5 and failures[5:] == [429] * 2


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


# 2. KDF parameters and wraps


def test_a_planted_huge_scrypt_cost_is_refused_before_any_derivation(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = host.device()
    sealed = _sealed(victim, 1)
    huge = _forged(sealed, kdf={"n": 2**30, "r": 8, "p": 1})
    response = victim.http.put(f"/accounts/{victim.account}/backups", content=huge)
    assert response.status_code == 400 and "not allowed" in response.text
    assert host.blobs() == [] and host.rows() == []
    # a host that serves it anyway: the client refuses before deriving (no 1 TiB allocation)
    started = time.perf_counter()
    with pytest.raises(BackupError, match="KDF parameters .* are not allowed"):
        unseal(dataclasses.replace(sealed, kdf={"n": 2**30, "r": 8, "p": 1}), passphrase=PASSPHRASE)
    many = dataclasses.replace(sealed, wraps=[dict(sealed.wraps[1]) for _ in range(sealing.MAX_WRAPS + 1)])
    with pytest.raises(BackupError, match="key wraps"):
        unseal(many, recovery_code="AAAAA-BBBBB-CCCCC-DDDDD")
    assert time.perf_counter() - started < 1.0
    # the production whitelist keeps the floor (tests swap in a cheaper set, blobs never can),
    # and a backup sealed at that cost restores
    assert PRODUCTION_KDF and all(p["n"] >= 2**17 and p["r"] >= 8 for p in PRODUCTION_KDF)
    monkeypatch.setattr(sealing, "KDF_ALLOWED", PRODUCTION_KDF)
    strong, _ = seal(LORA, PASSPHRASE, {"lora_name": "voice", "lora_version": 1}, victim.account, 0)
    assert strong.kdf == PRODUCTION_KDF[0] and unseal(strong, passphrase=PASSPHRASE) == LORA


def test_kdf_parameters_and_wrap_headers_are_bound_into_the_aad(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = host.device()
    sealed = _sealed(victim, 1)
    monkeypatch.setattr(sealing, "KDF_ALLOWED", (*sealing.KDF_ALLOWED, {"n": 2**11, "r": 8, "p": 1}))
    weaker = dataclasses.replace(sealed, kdf={"n": 2**11, "r": 8, "p": 1})
    with pytest.raises(BackupError, match="tampered"):
        unseal(weaker, passphrase=PASSPHRASE)
    salts = [dict(w) for w in sealed.wraps]
    salts[0]["salt"] = salts[1]["salt"]
    with pytest.raises(BackupError, match="tampered"):
        unseal(dataclasses.replace(sealed, wraps=salts), passphrase=PASSPHRASE)
    assert unseal(sealed, passphrase=PASSPHRASE) == LORA


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


# 3. input handling


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"meta_lora_version": 10**30}, "lora_version"),
        ({"meta_lora_version": True}, "lora_version"),
        ({"metadata": ["not", "a", "dict"]}, "metadata must be a JSON object"),
        ({"method": "rot13"}, "unknown backup method"),
        ({"meta_backup_id": "../../etc/passwd"}, "backup_id"),
        ({"wraps": "nope"}, "key wraps"),
        ({"meta_size_bytes": 1}, "size_bytes"),
    ],
)
def test_bad_blobs_get_400_and_leave_no_orphan(host: Host, changes: dict, words: str) -> None:
    victim = host.device()
    response = victim.http.put(
        f"/accounts/{victim.account}/backups", content=_forged(_sealed(victim, 1), **changes)
    )
    assert response.status_code == 400 and words in response.text, response.text
    assert host.blobs() == [] and host.rows() == []


def test_oversized_bodies_and_garbage_are_4xx_and_store_nothing(host: Host) -> None:
    victim = host.device()
    path = f"/accounts/{victim.account}/backups"
    big = victim.http.put(path, content=b"x" * (20 * 2**20))
    assert big.status_code == 413
    for garbage in (b"{not json", b"[1, 2]", b"null"):
        assert victim.http.put(path, content=garbage).status_code == 400
    assert host.blobs() == [] and host.rows() == []


def test_a_failing_blob_write_leaves_neither_row_nor_blob(
    host: Host, monkeypatch: pytest.MonkeyPatch
) -> None:
    victim = host.device()
    real_put = LocalBlobs.put

    def disk_full(self: LocalBlobs, key: str, data: bytes) -> None:
        real_put(self, key, data[: len(data) // 2])  # half written, then the disk fills
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(LocalBlobs, "put", disk_full)
    with pytest.raises(BackupError, match="503"):  # the host fails the request ...
        victim.upload(_sealed(victim, 1))
    assert host.blobs() == [] and host.rows() == []  # ... and keeps nothing of it
    monkeypatch.setattr(LocalBlobs, "put", real_put)
    victim.upload(_sealed(victim, 1))  # the same version can then be stored
    assert len(host.rows()) == 1


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


# 4. stronger secrets, AAD binding, no rollback


@pytest.mark.parametrize("weak", ["password1234", "aaaaaaaaaaaaaaaa", "qwertyuiop123", "short"])
def test_weak_passphrases_are_refused(weak: str) -> None:
    with pytest.raises(BackupError, match="passphrase"):
        seal(LORA, weak, {"lora_name": "voice", "lora_version": 1}, "acct-x")


def test_the_host_cannot_roll_back_or_relabel_a_version(host: Host) -> None:
    victim = host.device()
    v1 = victim.upload(_sealed(victim, 1))
    v2 = victim.upload(_sealed(victim, 2))
    assert victim.restore("voice", 2, passphrase=PASSPHRASE) == LORA
    blobs = host.folder / "blobs"
    old = json.loads((blobs / v1).read_bytes())
    # a malicious host answers the v2 request with the v1 blob
    (blobs / v2).write_bytes((blobs / v1).read_bytes())
    with pytest.raises(BackupError, match="asked for backup"):
        victim.restore("voice", 2, passphrase=PASSPHRASE)
    # ... or with v1 relabelled as v2 (backup id and version rewritten): the AAD no longer matches
    relabelled = {**old, "metadata": {**old["metadata"], "backup_id": v2, "lora_version": 2}}
    (blobs / v2).write_bytes(json.dumps(relabelled).encode())
    with pytest.raises(BackupError, match="tampered"):
        victim.restore("voice", 2, passphrase=PASSPHRASE)
    # ... or moves another account's backup into this one (account rewritten): refused the same way
    other = host.device()
    theirs = _sealed(other, 2)
    moved = _forged(theirs, meta_account=victim.account, meta_backup_id=v2)
    (blobs / v2).write_bytes(moved)
    with pytest.raises(BackupError, match="tampered"):
        victim.restore("voice", 2, passphrase=PASSPHRASE)
    # the client checks the authenticated metadata against what it asked for
    with pytest.raises(BackupError, match="lora_version=1"):
        unseal(Sealed.from_bytes(json.dumps(old).encode()), PASSPHRASE, expect={"lora_version": 2})
