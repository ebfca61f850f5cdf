"""``nimmer keys``: the publisher's Ed25519 signing keys and the folders that trust them."""

from __future__ import annotations

import argparse
from pathlib import Path

from nimmer_train.publish.signing import PUBLIC_SUFFIX, generate_key, trust


def register(parser: argparse.ArgumentParser) -> None:
    keys = parser.add_subparsers(dest="command", required=True)
    gen = keys.add_parser("generate", help="a new private key (0600) and its .pub beside it")
    gen.add_argument("private_key", type=Path)
    gen.add_argument("--trust", type=Path, default=None, help="also trust it: copy the .pub into this folder")
    tr = keys.add_parser("trust", help="add a public key to a trusted-keys folder")
    tr.add_argument("public_key", type=Path)
    tr.add_argument("trusted_dir", type=Path)


def run(args: argparse.Namespace) -> int:
    if args.command == "generate":
        kid = generate_key(args.private_key, args.trust)
        where = f"; trusted in {args.trust}" if args.trust else ""
        print(
            f"key {kid}: private {args.private_key} (keep it secret), "
            f"public {args.private_key.with_suffix(PUBLIC_SUFFIX)}{where}"
        )
    else:
        print(f"trusted key {trust(args.public_key, args.trusted_dir)} in {args.trusted_dir}")
    return 0
