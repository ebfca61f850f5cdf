"""``nimmer contributions``: what left this device and what it cost; an A.2 upload written or sent,
and the request to forget them (issue 23)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from nimmer_train.cli.common import open_player, stamp, trusted_keys
from nimmer_train.errors import NimmerError
from nimmer_train.federation.intake import write_upload
from nimmer_train.memory import contributions
from nimmer_train.memory.consent import a2_upload, get_consent, read_profile
from nimmer_train.memory.deletion_requests import make_request, record_answer
from nimmer_train.publish.released_rounds import federation_releases
from nimmer_train.publish.signing import Keyring

OUTBOX = "outbox"  # a device's uploads waiting to be handed to the operator, inside its folder


def register(log: argparse.ArgumentParser) -> None:
    log.add_argument("words", nargs="+", metavar="[upload|forget] PLAYER_DIR")
    log.add_argument("--json", action="store_true")
    log.add_argument(
        "--out",
        type=Path,
        default=None,
        help="upload: a folder (default PLAYER_DIR/outbox); forget: the request file (default in PLAYER_DIR)",
    )
    log.add_argument("--answer", type=Path, default=None, help="forget: the operator's answer file")
    log.add_argument("--intake", default=None, help="upload/forget through the operator's A.2 intake URL")
    log.add_argument(
        "--releases",
        type=Path,
        default=Path("releases"),
        help="show: the versions pulled here (default ./releases); a signed version that names a "
        "federation of this device says which of its rounds were released",
    )
    log.add_argument("--trusted-keys", type=Path, default=None, help="default: RELEASES/../keys/trusted")


def run(args: argparse.Namespace) -> int:
    action, folder = (
        (args.words[0], Path(args.words[1])) if len(args.words) == 2 else ("show", Path(args.words[0]))
    )
    if action == "show":
        refused = _learn_from_versions(folder, args)
        return _show(folder, args.json) or (1 if refused else 0)
    if action in ("upload", "forget") and args.intake:
        return _through_intake(action, folder, args.intake)
    if action == "upload":
        return _upload(folder, args.out)
    if action == "forget":
        return _forget(folder, args.out, args.answer)
    raise NimmerError(
        f"nimmer contributions {action}: unknown; use PLAYER_DIR, upload PLAYER_DIR or forget PLAYER_DIR"
    )


def _show(folder: Path, as_json: bool) -> int:
    """The log, a line per entry (each round released, not released or pending, as the server
    told), then the spend per federation and the running total across federations."""
    memory = open_player(folder)
    try:
        revoked_at = get_consent(memory).revoked_at
    finally:
        memory.close()
    log = contributions.entries(folder)
    spend = contributions.spend(folder)
    if as_json:
        print(json.dumps(log, indent=2))
        return 0
    lines = contributions.render(log) + contributions.render_spend(spend)
    if revoked_at is not None:
        lines.append(f"consent revoked since {stamp(revoked_at)}: nothing leaves this device")
    print("\n".join(lines) or f"{folder}: nothing has left this device yet")
    return 0


def _learn_from_versions(folder: Path, args: argparse.Namespace) -> list[str]:
    """Record what the signed versions in ``--releases`` say of this device's federations (their
    signatures verified first); print, on stderr, one line per version refused (nothing of it is
    believed, the log is unchanged by it) and return those lines."""
    claims, refused = federation_releases(args.releases, Keyring.load(trusted_keys(args)))
    open_player(folder).close()  # a player folder, before anything is written into it
    contributions.record_published(folder, claims)
    for line in refused:
        print(
            f"refused {line}; nothing it says of released rounds is believed (the contributions log "
            f"is unchanged by it): `nimmer versions verify` it, or pull it again",
            file=sys.stderr,
        )
    return refused


def _through_intake(action: str, folder: Path, url: str) -> int:
    """``contributions upload|forget PLAYER_DIR --intake URL``: through the operator's service."""
    # heavy: the intake service's web stack (FastAPI, httpx) takes a fifth of a second to import
    from nimmer_train.federation.intake_service import IntakeClient, device_key, forget_through, send_uploads

    memory = open_player(folder)
    try:
        client = IntakeClient(url, device_key(folder))
        if action == "upload":
            ids = send_uploads(memory, *read_profile(folder), client)
            print(f"sent {len(ids)} anonymised upload(s) to {url}: {', '.join(ids)}")
        else:
            answer = forget_through(memory, client)
            print(
                f"the intake forgot {len(answer['dropped'])} upload(s) ({len(answer['blocked'])} not held, "
                "refused should they arrive); forward-only: released adapters keep what they learned"
            )
    finally:
        memory.close()
    return 0


def _upload(folder: Path, out: Path | None) -> int:
    out = out if out is not None else folder / OUTBOX  # beside the device's stores, never the repository
    player_id, player_name = read_profile(folder)
    memory = open_player(folder)
    try:
        upload = a2_upload(memory, player_id, player_name)
    finally:
        memory.close()
    if upload is None:
        raise NimmerError(
            f"{folder} has nothing new to share for A2_anonymized (no entry goes into two uploads; "
            f"or its consent yields nothing: `nimmer consent show {folder}`)"
        )
    out.mkdir(parents=True, exist_ok=True)
    path = write_upload(upload, out)
    print(
        f"wrote {path}: upload {upload.upload_id}, {len(upload.examples)} anonymised examples; "
        "give it to the operator's intake"
    )
    return 0


def _forget(folder: Path, out: Path | None, answer: Path | None) -> int:
    memory = open_player(folder)
    try:
        if answer is not None:
            entry = record_answer(memory, answer)
            print(
                f"recorded the operator's answer: {len(entry['deleted'])} upload(s) dropped from the A.2 "
                f"pool, {len(entry['unknown'])} not in it (refused should they arrive); forward-only: "
                "adapters already released keep what they learned from them"
            )
            return 0
        name = f"deletion-request-{int(time.time())}.json"
        path = out / name if out is not None and out.is_dir() else out or folder / name  # a folder: inside it
        request = make_request(memory, path)
    finally:
        memory.close()
    print(
        f"wrote {path}: a request to forget {len(request['upload_ids'])} A.2 upload(s) (their ids only); "
        f"send it to the operator, then record the answer: "
        f"nimmer contributions forget {folder} --answer ANSWER"
    )
    return 0
