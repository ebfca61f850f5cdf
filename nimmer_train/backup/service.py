"""The backup host as a small HTTP service (FastAPI) over a :class:`BackupStore`, and the
device's client for it. Run it with ``backup.serving.serve(local_app(folder), host, port)`` (uvicorn
with deadlines on slow clients); the embedded default keeps blobs in local files.

    POST /accounts                     body: {"public_key": base64}  -> {"account": ...} (no signature)
    PUT  /accounts/{account}/backups   body: a sealed blob            -> {"backup_id": ...}
    GET  /accounts/{account}/backups                                  -> [metadata rows]
    GET  /backups/{backup_id}                                         -> the sealed blob

Every request but registration is signed by the device key (``backup/device.py``): an unsigned,
stale, replayed or wrongly signed request gets 401; a device reads and writes only its own account
(another account's list is 403, another account's backup 404); each account may make
:data:`RATE_LIMIT` requests per window (then 429), each address :data:`ADDRESS_RATE_LIMIT` whatever
account signs them (device keys are free to register, so accounts alone would not limit anyone),
and an address that keeps failing authentication is limited like an account. Bodies over
``max_body`` bytes get 413 before they are read in full; malformed blobs 400, a version already
stored 409.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.concurrency import run_in_threadpool

from nimmer_train.backup.device import (
    ACCOUNT_HEADER,
    MAX_SKEW_S,
    NONCE_HEADER,
    SIGNATURE_HEADER,
    TIMESTAMP_HEADER,
    DeviceAuth,
    DeviceKey,
    signed_message,
)
from nimmer_train.backup.sealing import BackupError, Sealed, unseal
from nimmer_train.backup.storage import (
    BackupConflict,
    BackupNotFound,
    BackupStore,
    BackupUnavailable,
    LocalBlobs,
)

MAX_BODY_BYTES = 8 * 2**20  # a sealed gameplay LoRA is well under this (base64 of a few MB)
RATE_LIMIT = (60, 60.0)  # requests per account (or failing address) per window of seconds
# every request from one address, whichever account signs it: registering more device keys
# (free) must not multiply an address's budget; room for a few devices behind one NAT
ADDRESS_RATE_LIMIT = (240, 60.0)
NONCE_RE = re.compile(r"[0-9a-f]{16,64}")
STAMP_RE = re.compile(r"[0-9]{1,12}")  # ASCII digits only: str.isdigit() admits "²" and 5000 digits


class RateLimiter:
    """A sliding-window count of requests per key, in memory (one host process). A key is kept
    only while its window holds hits: memory is bounded by the recent requests, not by every
    address that ever called."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self.hits: dict[str, deque[float]] = {}
        self.lock = threading.Lock()
        self.swept = time.monotonic()

    def _recent(self, key: str, now: float) -> deque[float]:
        if now - self.swept >= self.window_s:  # drop every key whose window has passed
            self.swept = now
            self.hits = {k: h for k, h in self.hits.items() if h and h[-1] > now - self.window_s}
        hits = self.hits.get(key, deque())
        while hits and hits[0] <= now - self.window_s:
            hits.popleft()
        if not hits:
            self.hits.pop(key, None)
        return hits

    def over(self, key: str) -> bool:
        with self.lock:
            return len(self._recent(key, time.monotonic())) >= self.limit

    def allow(self, key: str) -> bool:
        """Count one request for ``key``; False once the window already holds ``limit``."""
        with self.lock:
            now = time.monotonic()
            hits = self._recent(key, now)
            if len(hits) >= self.limit:
                return False
            hits.append(now)
            self.hits[key] = hits
            return True


@dataclass
class _Guard:
    """What every request passes before a route runs: the body cap, the rate limits and the
    device signature."""

    store: BackupStore
    max_body: int
    rate: tuple[int, float]
    limiter: RateLimiter
    per_address: RateLimiter

    async def read_body(self, request: Request) -> bytes:
        declared = request.headers.get("content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_body):
            raise HTTPException(413, f"the body is over the host's limit of {self.max_body} bytes")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self.max_body:
                raise HTTPException(413, f"the body is over the host's limit of {self.max_body} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    def refuse(self, address: str, reason: str) -> HTTPException:
        if not self.limiter.allow(f"addr:{address}"):
            return HTTPException(429, "too many failed requests from this address; wait a minute")
        return HTTPException(401, reason)

    async def authenticated(self, request: Request) -> tuple[str, bytes]:
        """The signing account and the body, or 401/413/429."""
        address = request.client.host if request.client else "?"
        if self.limiter.over(f"addr:{address}"):
            raise HTTPException(429, "too many failed requests from this address; wait a minute")
        if self.per_address.over(address):
            raise HTTPException(429, "too many requests from this address; wait a minute")
        body = await self.read_body(request)
        account = self._verify(request, address, body)
        if not self.limiter.allow(f"account:{account}"):
            raise HTTPException(
                429, f"rate limit: {self.rate[0]} requests per {self.rate[1]:.0f} s per account"
            )
        if not self.per_address.allow(address):
            raise HTTPException(429, "too many requests from this address; wait a minute")
        return account, body

    def _verify(self, request: Request, address: str, body: bytes) -> str:
        """The account whose device key signed this request (headers, timestamp, nonce), or 401."""
        h = request.headers
        account, stamp, nonce, signature = (
            h.get(k) for k in (ACCOUNT_HEADER, TIMESTAMP_HEADER, NONCE_HEADER, SIGNATURE_HEADER)
        )
        if not (account and stamp and nonce and signature):
            raise self.refuse(address, "the request is not signed by a device key")
        public = self.store.public_key(account)
        if public is None:
            raise self.refuse(address, "unknown backup account: register the device first (POST /accounts)")
        if not STAMP_RE.fullmatch(stamp) or abs(time.time() - int(stamp)) > MAX_SKEW_S:
            raise self.refuse(
                address, f"the request's timestamp is more than {MAX_SKEW_S} s off the host's clock"
            )
        message = signed_message(
            request.method, request.url.path, request.url.query, body, stamp, nonce, account
        )
        try:
            Ed25519PublicKey.from_public_bytes(public).verify(
                base64.b64decode(signature, validate=True), message
            )
        except (InvalidSignature, ValueError, binascii.Error) as exc:
            raise self.refuse(
                address, "the request's signature does not verify against the device key"
            ) from exc
        if not NONCE_RE.fullmatch(nonce) or not self.store.use_nonce(
            account, nonce, time.time(), 2 * MAX_SKEW_S
        ):
            raise self.refuse(address, "the request's nonce was already used (a replay) or is malformed")
        return account


def create_app(
    store: BackupStore,
    max_body: int = MAX_BODY_BYTES,
    rate: tuple[int, float] = RATE_LIMIT,
    address_rate: tuple[int, float] | None = None,
) -> FastAPI:
    app = FastAPI(title="nimmer LoRA backups")
    limiter = RateLimiter(*rate)
    guard = _Guard(store, max_body, rate, limiter, RateLimiter(*(address_rate or ADDRESS_RATE_LIMIT)))
    read_body, authenticated = guard.read_body, guard.authenticated

    def own(account: str, signer: str) -> None:
        if account != signer:
            raise HTTPException(403, "a device reads and writes only its own backup account")

    @app.post("/accounts")
    async def register(request: Request) -> dict[str, str]:
        address = request.client.host if request.client else "?"
        if not limiter.allow(f"register:{address}"):
            raise HTTPException(429, "too many registrations from this address; wait a minute")
        body = await read_body(request)
        try:
            data = json.loads(body)
            public = base64.b64decode(data["public_key"], validate=True)
            return {"account": store.register(public)}
        except (ValueError, TypeError, KeyError, RecursionError, binascii.Error, BackupError) as exc:
            raise HTTPException(400, f"register with {{'public_key': base64 of 32 bytes}}: {exc}") from exc

    @app.put("/accounts/{account}/backups")
    async def put_backup(account: str, request: Request) -> dict[str, str]:
        signer, body = await authenticated(request)
        own(account, signer)
        try:
            return {"backup_id": await run_in_threadpool(store.put, account, body)}
        except BackupConflict as exc:
            raise HTTPException(409, str(exc)) from exc
        except BackupUnavailable as exc:  # the database failed; nothing of the upload was kept
            raise HTTPException(503, str(exc)) from exc
        except BackupError as exc:
            raise HTTPException(400, str(exc)) from exc
        except OSError as exc:  # the blob store failed; nothing of the upload was kept
            raise HTTPException(503, f"the backup host could not store the blob ({exc}); try again") from exc

    @app.get("/accounts/{account}/backups")
    async def list_backups(account: str, request: Request) -> list[dict]:
        signer, _ = await authenticated(request)
        own(account, signer)
        return store.list(account)

    @app.get("/backups/{backup_id}")
    async def get_backup(backup_id: str, request: Request) -> Response:
        signer, _ = await authenticated(request)
        try:
            blob = await run_in_threadpool(store.get, signer, backup_id)
        except BackupNotFound as exc:
            raise HTTPException(404, str(exc)) from exc
        except BackupError as exc:
            raise HTTPException(500, str(exc)) from exc
        return Response(blob, media_type="application/octet-stream")

    return app


def local_app(folder: Path, **limits: Any) -> FastAPI:
    """The embedded default: SQLite metadata and blob files under ``folder``."""
    return create_app(BackupStore(folder / "backups.sqlite", LocalBlobs(folder / "blobs")), **limits)


class BackupClient:
    """The device's side of the service: it signs every request with the device key and sends
    and fetches sealed blobs only."""

    def __init__(self, base_url: str, device: DeviceKey, timeout: float = 30) -> None:
        self.device = device
        self.http = httpx.Client(base_url=base_url, timeout=timeout, auth=DeviceAuth(device))

    @property
    def account(self) -> str:
        return self.device.account

    def _check(self, response: httpx.Response, what: str) -> httpx.Response:
        if response.status_code != 200:
            raise BackupError(f"the backup host refused the {what} ({response.status_code}): {response.text}")
        return response

    def register(self) -> str:
        """Register the device key (once; again is harmless); returns the backup account id."""
        public = base64.b64encode(self.device.public_raw).decode()
        response = self._check(self.http.post("/accounts", json={"public_key": public}), "registration")
        account = response.json()["account"]
        if account != self.account:
            raise BackupError(f"the backup host answered account {account}, expected {self.account}")
        return account

    def upload(self, sealed: Sealed) -> str:
        response = self.http.put(f"/accounts/{self.account}/backups", content=sealed.to_bytes())
        return self._check(response, "upload").json()["backup_id"]

    def list(self) -> list[dict]:
        body = self._get(f"/accounts/{self.account}/backups", "listing")
        try:
            rows = json.loads(body)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise BackupError(f"the backup host's listing is not JSON ({type(exc).__name__})") from exc
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise BackupError("the backup host's listing is not a list of backups")
        return rows

    def _get(self, path: str, what: str) -> bytes:
        """GET ``path`` read raw (``identity`` asked, a content-encoded reply refused: no gzip
        bomb inflates here) and never past :data:`MAX_BODY_BYTES`, the most the host accepts."""
        with self.http.stream("GET", path, headers={"Accept-Encoding": "identity"}) as reply:
            encoding = reply.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise BackupError(
                    f"the backup host answered the {what} with Content-Encoding {encoding!r} although "
                    "identity was asked; refused unread"
                )
            body = bytearray()
            for chunk in reply.iter_raw():
                body += chunk
                if len(body) > MAX_BODY_BYTES:
                    raise BackupError(
                        f"the backup host's answer to the {what} is larger than {MAX_BODY_BYTES} bytes, "
                        "the most a backup can be; refused"
                    )
            if reply.status_code != 200:
                text = body[:500].decode(errors="replace")
                raise BackupError(f"the backup host refused the {what} ({reply.status_code}): {text}")
        return bytes(body)

    def download(self, backup_id: str) -> Sealed:
        sealed = Sealed.from_bytes(self._get(f"/backups/{backup_id}", f"download of {backup_id}"))
        if (sealed.metadata["backup_id"], sealed.metadata["account"]) != (backup_id, self.account):
            raise BackupError(
                f"asked for backup {backup_id}, the host answered {sealed.metadata['backup_id']} "
                f"of account {sealed.metadata['account']}; refusing it"
            )
        return sealed

    def restore(
        self,
        lora_name: str,
        lora_version: int,
        passphrase: str | None = None,
        recovery_code: str | None = None,
    ) -> bytes:
        """The LoRA bytes of ``lora_name`` version ``lora_version``: found, downloaded, and
        checked to be exactly that backup of this account (no rollback to an older one)."""
        rows = [r for r in self.list() if (r["lora_name"], r["lora_version"]) == (lora_name, lora_version)]
        if not rows:
            raise BackupError(f"no backup of {lora_name} version {lora_version} in account {self.account}")
        backup_id = rows[0]["backup_id"]
        expect = {
            "account": self.account,
            "backup_id": backup_id,
            "lora_name": lora_name,
            "lora_version": lora_version,
        }
        return unseal(self.download(backup_id), passphrase, recovery_code, expect=expect)
