"""The operator's A.2 intake as a small HTTP service (FastAPI, like the backup host), and the
device's client for it. ``nimmer federation a2 serve`` runs it; ``nimmer contributions upload
PLAYER_DIR --intake URL`` and ``forget PLAYER_DIR --intake URL`` use it.

    POST /devices     body: {"public_key": base64, "consent_tier": "A2_anonymized"} -> {"device": ...}
    POST /uploads     body: an upload (nimmer-a2-upload/1 + consent_tier)             -> {"accepted": id}
    POST /deletions   body: a deletion request (nimmer-a2-deletion-request/1)         -> the answer

Devices enrol an Ed25519 intake key (its own, not the backup key: the two accounts stay
unlinked) and sign every upload and deletion request with it (``backup/device.py``'s scheme:
unsigned, stale, replayed or wrongly signed requests get 401, an unenrolled key 401). Rate
limits per device and per address (429) and the body cap (413, naming the cap) are the backup
host's. Consent: a device enrols and uploads only under A2_anonymized consent, not revoked; the
client checks the player's consent record before it sends anything, and every enrolment and
upload states the tier (one without it is refused, 403). The intake cannot see the record: the
statement is the device's word, as everything it sends.

The k threshold comes before the pool: an upload is staged, and the staged uploads move into the
pool (the SQLite file the trainer reads) together, once uploads of at least k distinct enrolled
keys are staged (a key counts while an upload of it is staged, not once it is forgotten). k counts
keys, not people: anyone may enrol many keys, so the real protection is the pool's a2 k and
differential privacy; gating enrolment by operator-issued tokens is future work. Which key staged
which upload is held in memory only, never written down; a restarted intake waits for k new keys,
never fewer, and drops what was staged before it (no key owns it any more). Fewer than k keys
cannot hold the stage: a key may stage a k-th of its bytes, and an upload staged longer than
STAGE_TTL_S is dropped. Nothing beside an upload names a device: the pool and the stage hold upload ids
(random, device-chosen) and anonymised examples, in tables without a row order, dates to the
day. Caps: examples per upload and characters per value and per upload (413), uploads staged per
key (429) and bytes staged in all (507), upload ids per deletion request (400), per key per day
(429) and in the pool's deletions table (507); deletions run outside the stage's lock. The store
knows enrolled keys (authentication needs them) and nothing else of a device. Deletion is the file intake's
(``intake.forget_uploads``): the request names upload ids only, each a random uuid4 only its
device knows (the id is the proof of ownership); the uploads leave the stage and the pool, are
refused should they arrive again, and no later training reads them. The log is dated to the
day and names no upload nor any figure of one; uvicorn's access log (client addresses) is off,
and a reverse proxy's should be too.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import sqlite3
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.backup.device import ACCOUNT_HEADER, DeviceAuth, DeviceKey, account_id, small_order
from nimmer_train.backup.service import ADDRESS_RATE_LIMIT, RateLimiter, _Guard
from nimmer_train.errors import NimmerError
from nimmer_train.federation.intake import STORE_FILE, UPLOAD_FORMAT, forget_uploads, write_upload
from nimmer_train.memory.consent import a2_upload, get_consent, takes_part
from nimmer_train.memory.deletion_requests import REQUEST_FORMAT, make_request, read_document, record_answer
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.privacy.a2_pool import A2Pool
from nimmer_train.privacy.anonymize import Upload, scrub

log = logging.getLogger(__name__)

CONSENT_TIER = "A2_anonymized"
DAY = 86400.0
MAX_BODY_BYTES = 2**20  # one upload is a few hundred anonymised examples at most
RATE_LIMIT = (30, 60.0)  # requests per device per window of seconds
POOL_FILE, LOG_FILE = "a2_pool.sqlite", "intake.log"
MAX_EXAMPLES = 500  # examples in one upload
MAX_VALUE_CHARS = 8000  # characters in one example's value
# characters in one upload, keys and values: the contact-detail check is linear in them, so this
# bounds the CPU one signed request can buy (a few hundred examples of dialogue fit)
MAX_UPLOAD_CHARS = 2**18
MAX_DELETION_IDS = 1000  # upload ids in one deletion request
# upload ids one key may ask forgotten per window of seconds: every id not in the pool becomes a
# row of the pool's deletions (refused should it arrive), so a key's requests cost bounded rows
DELETION_QUOTA = (2 * MAX_DELETION_IDS, DAY)
MAX_DELETIONS = 2_000_000  # rows of the pool's deletions table (about 100 MB): then 507
MAX_STAGED_PER_DEVICE = 20  # uploads one enrolled key may have waiting for k keys
MAX_STAGED_BYTES = 256 * 2**20  # the whole stage, waiting for k keys; one key may hold 1/k of it
STAGE_TTL_S = 7 * DAY  # a staged upload not released by then is dropped (its key's room freed)
DEVICE_KEY_FILE = "a2_intake_key.pem"  # in the player folder, mode 0600; not the backup key
PENDING_DIR = "a2-pending"  # uploads made but not yet delivered (sent first next time)
# how `nimmer federation a2 serve` runs uvicorn: no access log (it would name client addresses)
SERVER_LOGGING = {"log_level": "info", "access_log": False}

SCHEMA = """
CREATE TABLE IF NOT EXISTS devices (account TEXT PRIMARY KEY, public_key BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS staged (upload_id TEXT PRIMARY KEY, examples TEXT NOT NULL) WITHOUT ROWID;
"""


def _day(now: float | None = None) -> float:
    """``now`` to the day: the intake keeps no time that could match an upload to a request."""
    now = time.time() if now is None else now
    return now - now % DAY


class StageFull(NimmerError):
    """A stage quota is reached: ``status`` is the HTTP answer (429 for one key, 507 for all)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class IntakeStore:
    """Enrolled device keys and staged uploads (``intake.sqlite``), the pool (``a2_pool.sqlite``)
    and, in memory, which enrolled keys have uploads staged (key -> staged ids; never written
    down) and the nonces seen. k counts distinct enrolled keys, not people or machines: one
    person may enrol many keys, so the pool's a2 k and differential privacy are the protection;
    gating enrolment by operator-issued tokens is future work."""

    def __init__(
        self,
        folder: Path,
        k: int,
        pool_path: Path | None = None,
        per_device: int = MAX_STAGED_PER_DEVICE,
        staged_bytes: int = MAX_STAGED_BYTES,
        ttl_s: float = STAGE_TTL_S,
    ) -> None:
        if k < 1:
            raise NimmerError(f"the intake's k threshold must be >= 1, got {k}")
        folder.mkdir(parents=True, exist_ok=True)
        self.k, self.pool_path = k, pool_path or folder / POOL_FILE
        self.store_path, self.per_device, self.staged_bytes = folder / STORE_FILE, per_device, staged_bytes
        self.db = sqlite3.connect(self.store_path, isolation_level=None, check_same_thread=False, timeout=30)
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=FULL")
        self.db.execute("PRAGMA secure_delete=ON")  # released and forgotten text leaves no bytes
        self.db.executescript(SCHEMA)
        self.ttl_s = ttl_s
        self.staged_by: dict[str, set[str]] = {}
        self.staged_at: dict[str, float] = {}  # upload id -> when staged (monotonic; in memory)
        self._drop(
            {r[0] for r in self.db.execute("SELECT upload_id FROM staged")}
        )  # owners are not written down: after a restart no key holds these, so they expire now
        self.nonces: dict[tuple[str, str], float] = {}
        self.lock = threading.Lock()
        A2Pool(self.pool_path, k).close()  # the trainer finds a pool (empty below k) from the start

    # what backup.service._Guard asks of a store
    def public_key(self, account: str) -> bytes | None:
        with self.lock:
            row = self.db.execute("SELECT public_key FROM devices WHERE account = ?", (account,)).fetchone()
        return None if row is None else bytes(row[0])

    def use_nonce(self, account: str, nonce: str, now: float, ttl: float) -> bool:
        """True the first time ``nonce`` is seen for ``account`` within ``ttl`` (in memory: a
        replay after a restart repeats an idempotent request)."""
        with self.lock:
            self.nonces = {key: t for key, t in self.nonces.items() if t > now - ttl}
            if (account, nonce) in self.nonces:
                return False
            self.nonces[(account, nonce)] = now
            return True

    def enrol(self, public: bytes) -> str:
        if len(public) != 32 or small_order(public):
            raise NimmerError("public_key must be 32 bytes of an Ed25519 public key (not of small order)")
        account = account_id(public)
        with self.lock:
            self.db.execute("INSERT OR IGNORE INTO devices VALUES (?, ?)", (account, public))
        return account

    def _drop(self, gone: set[str]) -> None:
        """Delete ``gone`` from the stage, leaving no byte of them in the store's files."""
        if gone:
            self.db.execute("BEGIN")
            self.db.executemany("DELETE FROM staged WHERE upload_id = ?", [(i,) for i in gone])
            self.db.execute("COMMIT")
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _prune(self, pool: A2Pool) -> None:
        """Drop from the stage every id asked forgotten (also by the operator's file-based
        ``a2 forget``) and every id staged longer than the TTL (so keys below k cannot hold the
        stage for good), and from the maps every id no longer staged."""
        staged = {r[0] for r in self.db.execute("SELECT upload_id FROM staged")}
        expired = time.monotonic() - self.ttl_s
        gone = {
            i
            for i in staged
            if self.staged_at.get(i, expired) <= expired
            or pool.db.execute("SELECT 1 FROM deletions WHERE upload_id = ?", (i,)).fetchone()
        }
        self._drop(gone)
        live = staged - gone
        self.staged_by = {a: ids & live for a, ids in self.staged_by.items() if ids & live}
        self.staged_at = {i: t for i, t in self.staged_at.items() if i in live}

    def _check_room(self, mine: set[str], size: int) -> None:
        """Refuse a new upload of ``size`` bytes over its key's quotas (uploads, and bytes: a
        k-th of the stage, so fewer than k keys cannot fill it; 429) or the stage's (507)."""
        if len(mine) >= self.per_device:
            raise StageFull(
                f"this device has {len(mine)} uploads waiting for k={self.k} devices (the quota of "
                f"{self.per_device} per device); send again once they are pooled",
                429,
            )
        marks = ",".join("?" * len(mine))
        (own,) = self.db.execute(
            f"SELECT COALESCE(SUM(LENGTH(examples)), 0) FROM staged WHERE upload_id IN ({marks})", list(mine)
        ).fetchone()
        if own + size > self.staged_bytes // self.k:
            raise StageFull(
                f"this device's uploads waiting for k={self.k} devices would pass its quota of "
                f"{self.staged_bytes // self.k} bytes (the stage's {self.staged_bytes} over k); send again "
                "once they are pooled",
                429,
            )
        (held,) = self.db.execute("SELECT COALESCE(SUM(LENGTH(examples)), 0) FROM staged").fetchone()
        if held + size > self.staged_bytes:
            raise StageFull(
                f"the intake's stage is full (its quota of {self.staged_bytes} bytes waiting for "
                f"k={self.k} devices); send again later",
                507,
            )

    def stage(self, account: str, upload: Upload) -> int:
        """Stage ``upload``; release the stage into the pool once uploads of k distinct enrolled
        keys are staged. Returns how many uploads were released (0 while the stage waits)."""
        with self.lock:
            pool = A2Pool(self.pool_path, self.k)
            try:
                if pool.db.execute(
                    "SELECT 1 FROM deletions WHERE upload_id = ?", (upload.upload_id,)
                ).fetchone():
                    raise NimmerError("this upload was asked forgotten; it is never pooled again")
                if pool.db.execute(
                    "SELECT 1 FROM uploads WHERE upload_id = ?", (upload.upload_id,)
                ).fetchone():
                    return 0  # already pooled (a resend): nothing new
                self._prune(pool)
                mine = self.staged_by.get(account, set())
                blob = json.dumps(upload.examples)
                if upload.upload_id not in mine:
                    self._check_room(mine, len(blob))
                cursor = self.db.execute(
                    "INSERT OR IGNORE INTO staged VALUES (?, ?)", (upload.upload_id, blob)
                )
                if cursor.rowcount == 1:  # a key counts for the uploads it staged, never for another's id
                    self.staged_by.setdefault(account, set()).add(upload.upload_id)
                    self.staged_at[upload.upload_id] = time.monotonic()
                if len(self.staged_by) < self.k:
                    return 0
                rows = self.db.execute("SELECT upload_id, examples FROM staged ORDER BY upload_id").fetchall()
                # one write transaction from the start (a deletion may commit meanwhile, outside
                # the lock); ids asked forgotten by then are skipped
                pool.db.execute("BEGIN IMMEDIATE")
                try:
                    for upload_id, examples in rows:
                        if not pool.db.execute(
                            "SELECT 1 FROM deletions WHERE upload_id = ?", (upload_id,)
                        ).fetchone():
                            pool.add(Upload(upload_id, tuple(json.loads(examples))), now=_day())
                    pool.db.execute("COMMIT")
                except BaseException:
                    pool.db.execute("ROLLBACK")
                    raise
                self.db.execute("DELETE FROM staged")
                self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                self.staged_by.clear()
                self.staged_at.clear()
                return len(rows)
            finally:
                pool.close()

    def forget(self, ids: list[str], max_rows: int = MAX_DELETIONS) -> dict[str, Any]:
        """Forward-only deletion of ``ids`` from the stage and the pool; the device's answer.
        The work runs outside the store's lock (SQLite orders it against a release; ``stage``
        prunes an id forgotten meanwhile), so uploads do not wait behind deletions. Refused
        (507) once the pool's deletions table holds ``max_rows``."""
        pool = A2Pool(self.pool_path, self.k)
        try:
            (rows,) = pool.db.execute("SELECT COUNT(*) FROM deletions").fetchone()
        finally:
            pool.close()
        if rows + len(ids) > max_rows:
            raise StageFull(
                f"the intake's list of forgotten uploads is full ({rows} of {max_rows} ids); ask the "
                "operator, whose `nimmer federation a2 forget` takes the request as a file",
                507,
            )
        answer = forget_uploads(self.pool_path, ids, self.k, self.store_path)
        gone = set(ids)
        with self.lock:
            self.staged_by = {a: s - gone for a, s in self.staged_by.items() if s - gone}
        answer["answered_at"] = _day(answer["answered_at"])
        return answer

    def close(self) -> None:
        self.db.close()


class IdQuota:
    """Upload ids asked forgotten per key in a sliding window, in memory: ``take`` counts a
    request's ids whole or refuses it. A key is kept only while its window holds requests."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit, self.window_s = limit, window_s
        self.taken: dict[str, list[tuple[float, int]]] = {}
        self.lock = threading.Lock()

    def take(self, key: str, n: int) -> bool:
        with self.lock:
            now = time.monotonic()
            self.taken = {
                k: kept
                for k, v in self.taken.items()
                if (kept := [(t, c) for t, c in v if t > now - self.window_s])
            }
            recent = self.taken.get(key, [])
            if sum(c for _, c in recent) + n > self.limit:
                return False
            self.taken[key] = [*recent, (now, n)]
            return True


class _IntakeGuard(_Guard):
    """The backup host's guard, with the intake's words for an unenrolled key."""

    def _verify(self, request: Request, address: str, body: bytes) -> str:
        account = request.headers.get(ACCOUNT_HEADER)
        if account and self.store.public_key(account) is None:
            raise self.refuse(address, "unknown intake device: enrol its key first (POST /devices)")
        return super()._verify(request, address, body)


def _json(body: bytes, what: str) -> dict[str, Any]:
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise HTTPException(400, f"the {what} is not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise HTTPException(400, f"the {what} must be a JSON object")
    return data


def _consented(data: dict[str, Any], what: str) -> None:
    if data.get("consent_tier") != CONSENT_TIER:
        raise HTTPException(
            403,
            f"the {what} does not state A.2 consent (consent_tier {data.get('consent_tier')!r}, expected "
            f"{CONSENT_TIER!r}); a device sends only under A2_anonymized consent",
        )


def _uuid(value: Any) -> bool:
    try:
        return str(uuid.UUID(str(value))) == value
    except ValueError:
        return False


def parse_upload(data: dict[str, Any]) -> Upload:
    """An upload body checked: format, a uuid4-shaped id, and at most MAX_EXAMPLES examples of
    strings (each at most MAX_VALUE_CHARS) that carry no contact details the device's anonymiser
    would have scrubbed. CPU-bound: the routes run it off the event loop."""
    if data.get("format") != UPLOAD_FORMAT:
        raise HTTPException(400, f"the upload has format {data.get('format')!r}, expected {UPLOAD_FORMAT!r}")
    upload_id, examples = data.get("upload_id"), data.get("examples")
    if not _uuid(upload_id):
        raise HTTPException(400, "upload_id must be a random uuid (the device's anonymiser makes one)")
    if not isinstance(examples, list) or not examples:
        raise HTTPException(400, "examples must be a non-empty list")
    if len(examples) > MAX_EXAMPLES:
        raise HTTPException(413, f"an upload holds at most {MAX_EXAMPLES} examples, this one {len(examples)}")
    for ex in examples:
        if not isinstance(ex, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in ex.items()
        ):
            raise HTTPException(400, "every example must be an object of strings")
        if any(len(v) > MAX_VALUE_CHARS for v in ex.values()):
            raise HTTPException(413, f"an example's value holds at most {MAX_VALUE_CHARS} characters")
    chars = sum(len(k) + len(v) for ex in examples for k, v in ex.items())
    if chars > MAX_UPLOAD_CHARS:
        raise HTTPException(
            413, f"an upload holds at most {MAX_UPLOAD_CHARS} characters (keys and values), this one {chars}"
        )
    for ex in examples:
        if any(scrub(v, "", "") != v for v in ex.values()):
            raise HTTPException(422, "an example carries contact details (email, url, ip, phone or address)")
    return Upload(upload_id, tuple(examples))


def _read_upload(body: bytes) -> Upload:
    data = _json(body, "upload")
    _consented(data, "upload")
    return parse_upload(data)


def create_app(
    store: IntakeStore,
    max_body: int = MAX_BODY_BYTES,
    rate: tuple[int, float] = RATE_LIMIT,
    address_rate: tuple[int, float] | None = None,
    deletion_quota: tuple[int, float] = DELETION_QUOTA,
) -> FastAPI:
    app = FastAPI(title="nimmer A.2 intake")
    limiter, forgetting = RateLimiter(*rate), IdQuota(*deletion_quota)
    guard = _IntakeGuard(store, max_body, rate, limiter, RateLimiter(*(address_rate or ADDRESS_RATE_LIMIT)))

    @app.post("/devices")
    async def enrol(request: Request) -> dict[str, str]:
        address = request.client.host if request.client else "?"
        if not limiter.allow(f"register:{address}"):
            raise HTTPException(429, "too many enrolments from this address; wait a minute")
        data = _json(await guard.read_body(request), "enrolment")
        _consented(data, "enrolment")
        try:
            public = base64.b64decode(str(data.get("public_key", "")), validate=True)
            return {"device": store.enrol(public)}
        except (binascii.Error, NimmerError) as exc:
            raise HTTPException(400, f"enrol with {{'public_key': base64 of 32 bytes}}: {exc}") from exc

    @app.post("/uploads")
    async def upload(request: Request) -> dict[str, str]:
        account, body = await guard.authenticated(request)
        parsed = await run_in_threadpool(_read_upload, body)  # JSON and the scrub check: CPU-bound
        try:
            released = await run_in_threadpool(store.stage, account, parsed)
        except StageFull as exc:
            raise HTTPException(exc.status, str(exc)) from exc
        except NimmerError as exc:
            raise HTTPException(409, str(exc)) from exc
        # no count: an exact pool figure is covered by no epsilon (only the noised release is)
        log.info("staged one upload%s", "; the stage reached k and went to the pool" if released else "")
        return {"accepted": parsed.upload_id}

    @app.post("/deletions")
    async def deletions(request: Request) -> dict[str, Any]:
        account, body = await guard.authenticated(request)
        data = _json(body, "deletion request")
        if data.get("format") != REQUEST_FORMAT:
            raise HTTPException(
                400, f"the deletion request has format {data.get('format')!r}, expected {REQUEST_FORMAT!r}"
            )
        ids = data.get("upload_ids")
        if not isinstance(ids, list) or not ids or len(ids) > MAX_DELETION_IDS:
            raise HTTPException(
                400, f"upload_ids must be a non-empty list of at most {MAX_DELETION_IDS} upload ids"
            )
        bad = next((i for i in ids if not _uuid(i)), None)
        if bad is not None:
            raise HTTPException(400, f"upload_ids holds {str(bad)[:64]!r}, not an upload id (a uuid)")
        if not forgetting.take(account, len(ids)):
            raise HTTPException(
                429,
                f"deletion quota: {forgetting.limit} upload ids per {forgetting.window_s:.0f} s per device "
                "key; send the rest later, or hand the request to the operator as a file",
            )
        try:
            answer = await run_in_threadpool(store.forget, ids)
        except StageFull as exc:
            raise HTTPException(exc.status, str(exc)) from exc
        log.info("answered a deletion request")  # no counts: they would tell one device's uploads
        return answer

    return app


def local_app(folder: Path, k: int, pool_path: Path | None = None, **limits: Any) -> FastAPI:
    """The embedded default: the intake's SQLite store and the pool under ``folder``."""
    return create_app(IntakeStore(folder, k, pool_path), **limits)


def log_to(path: Path) -> logging.Handler:
    """Append the intake's log (releases and answered requests, dated to the day) to ``path``;
    returns the handler."""
    handler = logging.FileHandler(path)
    # dates to the day: a time of day could match a line to a request seen elsewhere
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", datefmt="%Y-%m-%d"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    return handler


class IntakeClient:
    """The device's side: enrols its intake key and signs every upload and deletion request."""

    def __init__(self, base_url: str, device: DeviceKey, timeout: float = 30) -> None:
        self.base_url, self.device = base_url, device
        self.http = httpx.Client(base_url=base_url, timeout=timeout, auth=DeviceAuth(device))

    def _post(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        try:
            response = self.http.post(path, content=json.dumps(body).encode())
        except httpx.HTTPError as exc:
            raise NimmerError(f"could not reach the A.2 intake at {self.base_url} ({exc})") from exc
        if response.status_code != 200:
            raise NimmerError(
                f"the A.2 intake at {self.base_url} refused the {what} "
                f"({response.status_code}): {response.text}"
            )
        return response.json()

    def enrol(self) -> str:
        public = base64.b64encode(self.device.public_raw).decode()
        return self._post("/devices", {"public_key": public, "consent_tier": CONSENT_TIER}, "enrolment")[
            "device"
        ]

    def send(self, upload: Upload) -> None:
        body = {"format": UPLOAD_FORMAT, "upload_id": upload.upload_id, "examples": list(upload.examples)}
        self._post("/uploads", {**body, "consent_tier": CONSENT_TIER}, "upload")

    def forget(self, request: dict[str, Any]) -> dict[str, Any]:
        return self._post("/deletions", request, "deletion request")


def device_key(folder: Path) -> DeviceKey:
    """The player folder's intake key (made on first use, mode 0600)."""
    path = folder / DEVICE_KEY_FILE
    if not path.exists():
        DeviceKey.generate().save(path)
    return DeviceKey.load(path)


def send_uploads(memory: PlayerMemory, player_id: str, player_name: str, client: IntakeClient) -> list[str]:
    """Send the uploads left pending, then the next anonymised upload, through the intake; only
    under A2_anonymized consent, not revoked. Returns the ids delivered. An upload the intake
    could not take stays in ``a2-pending/`` and goes first next time."""
    reason = takes_part(get_consent(memory), CONSENT_TIER)
    if reason is not None:
        raise NimmerError(
            f"{memory.folder} sends no A.2 upload: {reason}; "
            f"`nimmer consent set {CONSENT_TIER} {memory.folder}` to share anonymised examples"
        )
    pending = memory.folder / PENDING_DIR
    queued = sorted(pending.glob("a2-upload-*.json")) if pending.exists() else []
    fresh = a2_upload(memory, player_id, player_name)
    if fresh is not None:
        queued.append(write_upload(fresh, _mkdir(pending)))
    if not queued:
        raise NimmerError(
            f"{memory.folder} has nothing new to share for {CONSENT_TIER} (no entry goes into two uploads)"
        )
    sent: list[str] = []
    try:
        client.enrol()
        for path in queued:
            data = read_document(path, UPLOAD_FORMAT)
            client.send(Upload(data["upload_id"], tuple(data["examples"])))
            path.unlink()
            sent.append(data["upload_id"])
    except NimmerError as exc:
        raise NimmerError(
            f"{exc}; {len(queued) - len(sent)} upload(s) wait in {pending}, sent next time"
        ) from exc
    return sent


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def forget_through(memory: PlayerMemory, client: IntakeClient) -> dict[str, Any]:
    """Ask the intake to forget every upload of this device not yet asked about; the answer is
    kept beside the request and recorded in the contributions log."""
    path = memory.folder / f"deletion-request-{int(time.time())}.json"
    request = make_request(memory, path)
    try:
        answer = client.forget(request)
    except NimmerError as exc:
        raise NimmerError(
            f"{exc}; the request is kept at {path}: hand it to the operator, whose "
            "`nimmer federation a2 forget` drops the uploads from the pool and the intake's stage"
        ) from exc
    answer_path = path.with_name(path.stem + ".answer.json")
    write_json_atomic(answer_path, answer)
    record_answer(memory, answer_path)
    return answer
