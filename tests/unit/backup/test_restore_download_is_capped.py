"""Adversarial review of ``nimmer backup restore`` (issue 42): a hostile backup host on loopback
answers a download with a gzip bomb (a small body that inflates far past any sealed LoRA) or an
endless plain body. The device must refuse both without inflating or holding them: it asks for
identity, refuses a content-encoded reply and stops reading past the host's own upload limit."""

from __future__ import annotations

import gzip
from collections.abc import AsyncIterator

import pytest
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from nimmer_train.backup.device import DeviceKey
from nimmer_train.backup.sealing import BackupError
from nimmer_train.backup.service import MAX_BODY_BYTES, BackupClient
from tests.helpers.loopback import serve_app

BOMB = gzip.compress(b"\0" * (MAX_BODY_BYTES * 16), compresslevel=9)  # ~130 kB on the wire


async def bomb(request: object) -> Response:
    return Response(BOMB, headers={"Content-Encoding": "gzip", "Content-Type": "application/json"})


async def endless(request: object) -> StreamingResponse:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(MAX_BODY_BYTES // (1 << 20) * 4):
            yield b" " * (1 << 20)

    return StreamingResponse(chunks(), media_type="application/json")


@pytest.mark.parametrize(("route", "words"), [(bomb, "Content-Encoding 'gzip'"), (endless, "larger than")])
def test_a_download_or_listing_is_refused_unread_past_the_hosts_own_limit(route: object, words: str) -> None:
    app = Starlette(routes=[Route("/backups/{backup_id}", route), Route("/accounts/{a}/backups", route)])
    with serve_app(app) as url:
        client = BackupClient(url, DeviceKey.generate())
        with pytest.raises(BackupError, match=words):
            client.download("b" * 32)
        with pytest.raises(BackupError, match=words):
            client.list()
