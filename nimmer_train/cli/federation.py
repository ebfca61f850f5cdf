"""``nimmer federation``: the operator's side, the SuperLink's certificates and the A.2 intake
pool (issue 23)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.certs import make_certificates
from nimmer_train.federation.intake import add_uploads, apply_deletion_request, pooled_ids
from nimmer_train.privacy.a2_pool import pool_summary

CERTS = Path("federation/certs")  # under the operator's git-ignored federation/ folder


def register(parser: argparse.ArgumentParser) -> None:
    federation = parser.add_subparsers(dest="command", required=True)
    certs = federation.add_parser("certs", help="a CA (reused if present) and the SuperLink's certificate")
    certs.add_argument(
        "folder",
        type=Path,
        nargs="?",
        default=CERTS,
        help=f"default {CERTS} (git-ignored: the CA's key is there)",
    )
    certs.add_argument("--host", action="append", required=True, help="a name or address of the SuperLink")
    certs.add_argument("--days", type=int, default=365)
    a2 = federation.add_parser("a2", help="the A.2 intake pool").add_subparsers(
        dest="a2_command", required=True
    )
    k = FederatedConfig().a2.k
    for name, text in (
        ("add", "pool anonymised upload files"),
        ("status", "the pool's counts and upload ids (operator only)"),
        ("forget", "apply a device's deletion request; writes the answer for it"),
    ):
        cmd = a2.add_parser(name, help=text)
        cmd.add_argument("--pool", type=Path, required=True)
        cmd.add_argument("--k", type=int, default=k, help=f"the pool's training threshold (default {k})")
        if name == "add":
            cmd.add_argument("files", type=Path, nargs="+")
        elif name == "forget":
            cmd.add_argument("request", type=Path)
            cmd.add_argument("--answer", type=Path, default=None, help="default: REQUEST.answer.json")
    serve = a2.add_parser("serve", help="the intake as an HTTP service devices upload through")
    serve.add_argument("--folder", type=Path, required=True, help="the intake's store, pool and log")
    serve.add_argument("--pool", type=Path, default=None, help="default: FOLDER/a2_pool.sqlite")
    serve.add_argument("--k", type=int, default=k, help=f"distinct enrolled keys to release (default {k})")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8470)
    serve.add_argument("--max-body", type=int, default=2**20, help="bytes per request (413 above)")


def run(args: argparse.Namespace) -> int:
    if args.command == "certs":
        made = make_certificates(args.folder, args.host, args.days)
        print(
            f"{'reused' if made.ca_reused else 'new'} CA {made.ca} (give it to contributors; keep "
            f"{made.ca_key} offline); server certificate {made.server} and key {made.server_key} "
            f"for {', '.join(args.host)}"
        )
        return 0
    if args.a2_command == "serve":
        return _a2_serve(args)
    if args.a2_command == "add":
        ids, forgotten = add_uploads(args.pool, args.files, args.k)
        print(f"pooled {len(ids)} upload(s) in {args.pool}: {', '.join(ids)}")
        if forgotten:
            print(f"refused {len(forgotten)} upload(s) their players asked forgotten (files deleted)")
    elif args.a2_command == "status":
        print(
            json.dumps(
                {**pool_summary(args.pool, args.k), "upload_ids": pooled_ids(args.pool, args.k)}, indent=2
            )
        )
    else:
        answer = apply_deletion_request(args.pool, args.request, args.k)
        path = args.answer or args.request.with_name(args.request.stem + ".answer.json")
        write_json_atomic(path, answer)
        print(
            f"forgot {len(answer['dropped'])} upload(s) in {args.pool} ({len(answer['blocked'])} were not "
            f"pooled and are now refused); answer for the device: {path}"
        )
    return 0


def _a2_serve(args: argparse.Namespace) -> int:
    # heavy: the intake service's web stack (FastAPI, uvicorn) takes a fifth of a second to import
    from nimmer_train.backup.serving import serve
    from nimmer_train.federation.intake_service import LOG_FILE, SERVER_LOGGING, local_app, log_to

    app = local_app(args.folder, args.k, args.pool, max_body=args.max_body)
    log_to(args.folder / LOG_FILE)
    pool = args.pool or args.folder / "a2_pool.sqlite"
    print(
        f"A.2 intake on http://{args.host}:{args.port} (k={args.k}); the pool for training: {pool}",
        flush=True,
    )
    serve(app, args.host, args.port, **SERVER_LOGGING)  # with deadlines on slow clients
    return 0
