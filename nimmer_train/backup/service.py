"""The backup host as a small HTTP service (FastAPI) over a :class:`BackupStore`, and the
device's client for it. Run it with ``uvicorn``; the embedded default keeps blobs in local files.

    PUT  /accounts/{account}/backups   body: a sealed blob   -> {"backup_id": ...}
    GET  /accounts/{account}/backups                         -> [metadata rows]
    GET  /backups/{backup_id}                                -> the sealed blob
"""

from __future__ import annotations

from pathlib import Path

import httpx
from fastapi import FastAPI, HTTPException, Request, Response

from nimmer_train.backup.sealing import BackupError, Sealed
from nimmer_train.backup.storage import BackupStore, LocalBlobs


def create_app(store: BackupStore) -> FastAPI:
    app = FastAPI(title="nimmer LoRA backups")

    @app.put("/accounts/{account}/backups")
    async def put_backup(account: str, request: Request) -> dict[str, str]:
        try:
            return {"backup_id": store.put(account, await request.body())}
        except BackupError as exc:
            raise HTTPException(status_code=400, detail=str(exc)) from exc

    @app.get("/accounts/{account}/backups")
    def list_backups(account: str) -> list[dict]:
        return store.list(account)

    @app.get("/backups/{backup_id}")
    def get_backup(backup_id: str) -> Response:
        try:
            return Response(store.get(backup_id), media_type="application/octet-stream")
        except BackupError as exc:
            raise HTTPException(status_code=404, detail=str(exc)) from exc

    return app


def local_app(folder: Path) -> FastAPI:
    """The embedded default: SQLite metadata and blob files under ``folder``."""
    return create_app(BackupStore(folder / "backups.sqlite", LocalBlobs(folder / "blobs")))


class BackupClient:
    """The device's side of the service: it sends and fetches sealed blobs only."""

    def __init__(self, base_url: str, timeout: float = 30) -> None:
        self.http = httpx.Client(base_url=base_url, timeout=timeout)

    def upload(self, account: str, sealed: Sealed) -> str:
        response = self.http.put(f"/accounts/{account}/backups", content=sealed.to_bytes())
        if response.status_code != 200:
            raise BackupError(f"the backup host refused the upload ({response.status_code}): {response.text}")
        return response.json()["backup_id"]

    def list(self, account: str) -> list[dict]:
        response = self.http.get(f"/accounts/{account}/backups")
        response.raise_for_status()
        return response.json()

    def download(self, backup_id: str) -> Sealed:
        response = self.http.get(f"/backups/{backup_id}")
        if response.status_code != 200:
            raise BackupError(f"backup {backup_id}: {response.status_code} {response.text}")
        return Sealed.from_bytes(response.content)
