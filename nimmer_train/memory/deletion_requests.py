"""Forgetting A.2 uploads, the device's side: a deletion request for this device's own upload
ids (the only link between the device and its anonymised uploads is the list of ids it keeps,
``consent.sent_uploads``), and the operator's answer recorded in the contributions log.

The request names upload ids only (no player id, no contributor id). The operator's intake
applies it to the pool (``nimmer federation a2 forget``): forward-only deletion, the pool drops
the uploads and refuses them if they ever arrive again; adapters already released keep what
they learned from them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.errors import NimmerError
from nimmer_train.memory import contributions
from nimmer_train.memory.consent import request_deletion, sent_uploads
from nimmer_train.memory.player_memory import PlayerMemory

REQUEST_FORMAT = "nimmer-a2-deletion-request/1"
ANSWER_FORMAT = "nimmer-a2-deletion-answer/1"


def make_request(memory: PlayerMemory, out: Path) -> dict[str, Any]:
    """Ask for every upload not yet asked about; write the request to ``out``, then mark the
    uploads asked and log it (a request that could not be written leaves them to ask again)."""
    ids = sent_uploads(memory, pending_only=True)
    if not ids:
        sent = len(sent_uploads(memory))
        raise NimmerError(
            f"{memory.folder} has no A.2 upload left to forget ({sent} sent, all already asked deleted)"
            if sent
            else f"{memory.folder} never sent an A.2 upload: there is nothing to forget"
        )
    request = {"format": REQUEST_FORMAT, "upload_ids": ids, "requested_at": memory.clock()}
    try:
        write_json_atomic(out, request)
    except OSError as exc:
        raise NimmerError(
            f"could not write the deletion request to {out} ({exc}); choose another --out"
        ) from exc
    request_deletion(memory, ids=ids)
    contributions.record(memory.folder, "deletion_request", upload_ids=ids, request=str(out))
    return request


def read_document(path: Path, expected: str) -> dict[str, Any]:
    """A request or answer file, checked for its format."""
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise NimmerError(f"{path} is not a readable JSON document ({exc})") from exc
    if not isinstance(data, dict) or data.get("format") != expected:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise NimmerError(f"{path} has format {got!r}, expected {expected!r}")
    return data


def record_answer(memory: PlayerMemory, answer_file: Path) -> dict[str, Any]:
    """Log the operator's answer; it must concern only uploads this device asked to forget."""
    answer = read_document(answer_file, ANSWER_FORMAT)
    asked = set(
        r[0]
        for r in memory.primary.execute(
            "SELECT upload_id FROM a2_uploads WHERE deletion_requested_at IS NOT NULL"
        )
    )
    for key in ("dropped", "blocked"):
        if not isinstance(answer.get(key), list) or not all(isinstance(i, str) for i in answer[key]):
            raise NimmerError(f"{answer_file}: {key} must be a list of upload ids")
    named = set(answer["dropped"]) | set(answer["blocked"])
    if not named <= asked:
        raise NimmerError(
            f"{answer_file} answers for {len(named - asked)} upload(s) this device never asked to forget; "
            "is it another device's answer?"
        )
    return contributions.record(
        memory.folder,
        "deletion_answer",
        deleted=sorted(answer["dropped"]),
        unknown=sorted(answer["blocked"]),
        answered_at=answer.get("answered_at"),
    )
