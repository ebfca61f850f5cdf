"""``nimmer contribute``: this player joins a federation as a Flower SuperNode, over the very
bytes of a verified version, while its consent lasts (issue 23)."""

from __future__ import annotations

import argparse
from pathlib import Path

from nimmer_train.cli.common import open_player, stamp, trusted_keys
from nimmer_train.errors import NimmerError
from nimmer_train.federation.deploy import SuperNode, free_port, node_config, run_supernode
from nimmer_train.memory.consent import consent_view, contributor_id, get_consent, read_profile, takes_part
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import open_version, verified_copy


def register(contribute: argparse.ArgumentParser) -> None:
    contribute.add_argument("player_dir", type=Path)
    contribute.add_argument("--superlink", required=True, help="the operator's HOST:PORT (Flower 1.42: 8000)")
    contribute.add_argument("--root-certificates", type=Path, required=True, help="the operator's ca.crt")
    contribute.add_argument("--releases", type=Path, default=Path("releases"))
    contribute.add_argument("--version", default="production", help="the base version the federation names")
    contribute.add_argument("--register", default=None, help="the register LoRA the federation improves")
    contribute.add_argument(
        "--trusted-keys", type=Path, default=None, help="default: RELEASES/../keys/trusted"
    )
    contribute.add_argument(
        "--port", type=int, default=0, help="the SuperNode's local port (default: a free one)"
    )
    contribute.add_argument("--host", default="127.0.0.1", help="the SuperNode's local address")


def run(args: argparse.Namespace) -> int:
    folder: Path = args.player_dir.resolve()
    memory = open_player(folder)
    try:
        record = get_consent(memory)
        reason = takes_part(record)
        if reason is not None:
            raise NimmerError(
                f"{folder} takes no part in federated rounds: {reason}; "
                f"`nimmer consent set A1_federated {folder}` to contribute"
            )
        read_profile(folder)
        ident = contributor_id(memory)
    finally:
        memory.close()
    view = consent_view(record)  # what the consent filter lets leave, exactly
    excluded = f"; excluded {', '.join(view['categories_excluded'])}" if view["categories_excluded"] else ""
    print(
        f"consent: A1_federated since {stamp(record.granted_at)}, sharing "
        f"{', '.join(view['categories_shared'])}{excluded}; never {', '.join(view['never_shared'])}; "
        f"contributor id {ident} (stays on this device); only the masked update leaves it",
        flush=True,
    )
    if not args.root_certificates.is_file():
        raise NimmerError(
            f"--root-certificates {args.root_certificates}: no such file (the operator's ca.crt)"
        )
    keyring = Keyring.load(trusted_keys(args))
    version = open_version(args.releases, args.version, keyring)
    register_name = _register(version.loras, args.register, version.label)
    print(
        f"verified {version.label}: signature and every file's sha256; register {register_name}", flush=True
    )
    port = args.port or free_port(args.host)

    def still_takes_part() -> str | None:
        memory = open_player(folder)
        try:
            return takes_part(get_consent(memory))
        finally:
            memory.close()

    with verified_copy(version) as copy:  # the SuperNode loads the very bytes verified
        node = SuperNode(
            args.superlink,
            args.root_certificates.resolve(),
            node_config(copy.folder, copy.loras[register_name], folder, args.superlink),
            port,
            folder / ".flower",
        )
        print(
            f"starting a Flower SuperNode: SuperLink {args.superlink} over TLS "
            f"(CA {args.root_certificates}), local port {port}",
            flush=True,
        )
        code = run_supernode(node, still_takes_part, lambda line: print(line, flush=True))
    if code:
        raise NimmerError(f"the SuperNode exited with code {code}; its log is above")
    return 0


def _register(loras: dict[str, Path], wanted: str | None, label: str) -> str:
    if wanted:
        if wanted not in loras:
            raise NimmerError(
                f"no LoRA of register {wanted} fits {label}; fitting: {', '.join(loras) or 'none'}"
            )
        return wanted
    if len(loras) != 1:
        raise NimmerError(
            f"{label} has {len(loras)} fitting register LoRAs ({', '.join(loras) or 'none'}); "
            "pass --register, the one the federation improves"
        )
    return next(iter(loras))
