"""The ``nimmer`` command: player stores on this device, published versions, signing keys.

nimmer memory inspect PLAYER_DIR
nimmer memory generate PLAYER_DIR [--seed N] [--entries N]
nimmer versions [--releases DIR] [--trusted-keys DIR] list | show V | verify V | promote V
nimmer keys generate PRIVATE_KEY [--trust DIR]
nimmer keys trust PUBLIC_KEY DIR
nimmer serve [--releases DIR] [--version production] [--host 127.0.0.1] [--port 8000] [--api-key-env VAR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nimmer_train.errors import NimmerError
from nimmer_train.publish.listing import print_versions


def inspect_player(folder: Path) -> dict:
    """Counts by class and category, the last snapshot and integrity, for primary, fallback and
    companion. The clasp store is not inspected: nothing but in-between retrieval reads it."""
    from nimmer_train.memory.companion import COMPANION_FILE, open_companion
    from nimmer_train.memory.db import connect, integrity_ok
    from nimmer_train.memory.player_memory import PRIMARY_FILE
    from nimmer_train.memory.sync import FALLBACK_FILE

    report: dict = {"player": folder.name}
    for name in (PRIMARY_FILE, FALLBACK_FILE):
        path = folder / name
        if not path.exists():
            report[name] = "absent"
            continue
        db = connect(path)
        rows = db.execute("SELECT memory_class, data_category FROM entries").fetchall()
        info = {
            "integrity": "ok" if integrity_ok(db) else "FAILED",
            "entries": len(rows),
            "by_class": dict(Counter(r[0] for r in rows)),
            "by_category": dict(Counter(r[1] for r in rows)),
        }
        if name == FALLBACK_FILE:
            taken = db.execute("SELECT taken_at FROM snapshot_meta WHERE id = 1").fetchone()
            info["snapshot_taken_at"] = taken[0] if taken else None
        report[name] = info
        db.close()
    if (folder / COMPANION_FILE).exists():
        db = open_companion(folder)
        report[COMPANION_FILE] = {
            "sessions": db.execute("SELECT COUNT(*) FROM sessions").fetchone()[0],
            "decisions": db.execute("SELECT COUNT(*) FROM decision_log").fetchone()[0],
        }
        db.close()
    report["clasp"] = "not inspectable by design (read only by in-between retrieval)"
    return report


def show_version(releases: Path, name: str) -> dict[str, Any]:
    """Everything the registry holds about one version (``nimmer versions show``)."""
    from nimmer_train.publish.registry import Registry

    registry = Registry.open(releases)
    try:
        v = registry.find(name)
        out = dict(v.row)
        out["aliases"] = sorted(a for a, label in registry.aliases().items() if label == v.label)
        out["folder"] = str(v.folder)
        out["loras"] = [
            {k: lora[k] for k in ("lora_id", "register", "relation", "mlflow_model_version")}
            for lora in registry.loras_for(v)
        ]
        out["federated_gradient_uploads"] = registry.uploads_into(v)
        files = out.pop("blob_distribution")["files"]
        out["blob_distribution"] = [f"{f['path']}  {f['size']} B  sha256 {f['sha256']}" for f in files]
        out["blob_base_url"] = files[0]["location"].rsplit("/", 2)[0] if files else None
        recipe = out["training_recipe_ref"]
        recipe.pop("publish_config", None)  # the full resolved config: in manifest.json and MLflow
        out["training_corpus_refs"]["literary"].pop("sources", None)
    finally:
        registry.close()
    return out


def _versions(args: argparse.Namespace) -> int:
    from nimmer_train.publish.manifest import SIGNATURE
    from nimmer_train.publish.registry import REGISTRY_FILE, Registry
    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import verify_version

    releases: Path = args.releases
    if args.command == "list":
        print_versions(releases)
    elif args.command == "show":
        print(json.dumps(show_version(releases, args.version), indent=2))
    elif args.command == "verify":
        keyring = Keyring.load(args.trusted_keys or releases.parent / "keys" / "trusted")
        registry = Registry.open(releases)
        try:
            started = time.perf_counter()
            verified = verify_version(registry, registry.find(args.version), keyring)
            seconds = time.perf_counter() - started
        finally:
            registry.close()
        files = verified.manifest["blob_distribution"]["files"]
        size = sum(f["size"] for f in files)
        sig = json.loads((verified.folder / SIGNATURE).read_text())
        print(
            f"{verified.label}: signature OK (key {sig['key_id']}); {len(files)} files, {size / 1e6:.1f} MB "
            f"match their sha256 ({seconds:.2f} s); LoRAs OK: {', '.join(verified.loras) or 'none'}"
        )
    else:  # promote
        registry = Registry.open(releases)
        try:
            with registry.writing():
                version = registry.find(args.version)
                registry.set_alias(args.alias, version, datetime.now(UTC).isoformat(timespec="seconds"))
            print(f"{version.label} is now {args.alias!r} in {releases / REGISTRY_FILE}")
            uri = registry.setting("mlflow_tracking_uri")
            if uri:
                from nimmer_train.publish import mlflow_registry

                numbers = mlflow_registry.sync(registry, uri)
                print(
                    f"MLflow: {mlflow_registry.BASE_MODEL}@{args.alias} -> version {numbers[version.label]}"
                )
        finally:
            registry.close()
    return 0


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def serve_api_key(host: str, api_key_env: str | None) -> str | None:
    """The bearer token ``nimmer serve`` requires (from the environment variable named), or
    None on loopback without one; binding beyond loopback without a token is refused."""
    if api_key_env:
        key = os.environ.get(api_key_env, "")
        if len(key) < 16:
            raise NimmerError(
                f"--api-key-env {api_key_env}: the variable is unset or shorter than 16 characters; "
                "set it to a long random token (`python -c 'import secrets; print(secrets.token_hex())'`)"
            )
        return key
    if host not in LOOPBACK:
        raise NimmerError(
            f"--host {host} binds beyond loopback: anyone who reaches it could use the model; "
            "pass --api-key-env VAR (clients send Authorization: Bearer $VAR) or bind 127.0.0.1"
        )
    return None


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from nimmer_train.runtime.local_model import LocalModel
    from nimmer_train.runtime.openai_server import create_app, model_ids

    api_key = serve_api_key(args.host, args.api_key_env)
    trusted = args.trusted_keys or args.releases.parent / "keys" / "trusted"
    model = LocalModel.open(args.releases, args.version, trusted)
    auth = " (bearer token required)" if api_key else ""
    print(f"serving {', '.join(model_ids(model))} on http://{args.host}:{args.port}/v1{auth}", flush=True)
    uvicorn.run(create_app(model, api_key=api_key), host=args.host, port=args.port, log_level="warning")
    return 0


def _keys(args: argparse.Namespace) -> int:
    from nimmer_train.publish.signing import PUBLIC_SUFFIX, generate_key, trust

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


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.group == "serve":
            return _serve(args)
        if args.group == "versions":
            return _versions(args)
        if args.group == "keys":
            return _keys(args)
    except NimmerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return _memory(args)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nimmer", description="nimmer-train device tools")
    groups = parser.add_subparsers(dest="group", required=True)
    _add_memory(groups)
    _add_versions(groups)
    _add_keys(groups)
    _add_serve(groups)
    return parser


def _add_memory(groups: Any) -> None:
    memory = groups.add_parser("memory", help="a player's local memory stores").add_subparsers(
        dest="command", required=True
    )
    inspect_cmd = memory.add_parser(
        "inspect", help="counts, last snapshot and integrity of a player's stores"
    )
    inspect_cmd.add_argument("player_dir", type=Path)
    generate = memory.add_parser("generate", help="fill a player folder with a seeded synthetic player")
    generate.add_argument("player_dir", type=Path)
    generate.add_argument("--seed", type=int, default=0)
    generate.add_argument("--entries", type=int, default=200)


def _add_versions(groups: Any) -> None:
    versions = groups.add_parser("versions", help="published nimmerworld base versions")
    versions.add_argument("--releases", type=Path, default=Path("releases"), help="default: ./releases")
    versions.add_argument("--trusted-keys", type=Path, default=None, help="default: RELEASES/../keys/trusted")
    vcmd = versions.add_subparsers(dest="command", required=True)
    vcmd.add_parser("list", help="every version with epsilon, contributors, LoRAs and aliases")
    for name, text in (
        ("show", "everything the registry holds about a version"),
        ("verify", "check the signature and every file's sha256"),
        ("promote", "point the production alias (registry and MLflow) at a version"),
    ):
        cmd = vcmd.add_parser(name, help=text)
        cmd.add_argument("version", help="vN, nimmerworld-base-vN, candidate or production")
        if name == "promote":
            cmd.add_argument("--alias", default="production")


def _add_keys(groups: Any) -> None:
    keys = groups.add_parser("keys", help="Ed25519 publisher keys").add_subparsers(
        dest="command", required=True
    )
    gen = keys.add_parser("generate", help="a new private key (0600) and its .pub beside it")
    gen.add_argument("private_key", type=Path)
    gen.add_argument("--trust", type=Path, default=None, help="also trust it: copy the .pub into this folder")
    tr = keys.add_parser("trust", help="add a public key to a trusted-keys folder")
    tr.add_argument("public_key", type=Path)
    tr.add_argument("trusted_dir", type=Path)


def _add_serve(groups: Any) -> None:
    serve = groups.add_parser("serve", help="an OpenAI-compatible server over a verified version (Ring B)")
    serve.add_argument("--releases", type=Path, default=Path("releases"))
    serve.add_argument("--trusted-keys", type=Path, default=None, help="default: RELEASES/../keys/trusted")
    serve.add_argument(
        "--version", default="production", help="vN, a label or an alias (default: production)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key-env",
        default=None,
        help="environment variable holding a bearer token every request must send; "
        "required to bind beyond loopback",
    )


def _memory(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        if not args.player_dir.is_dir():
            print(f"error: no player folder at {args.player_dir}", file=sys.stderr)
            return 2
        print(json.dumps(inspect_player(args.player_dir), indent=2))
    else:
        from nimmer_train.memory.embedding import SentenceEmbedder
        from nimmer_train.memory.synthetic import generate_player

        print(
            json.dumps(
                generate_player(args.player_dir, SentenceEmbedder(), args.seed, args.entries), indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
