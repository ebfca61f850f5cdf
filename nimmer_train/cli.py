"""The ``nimmer`` command: player stores on this device, published versions, signing keys.

nimmer memory inspect PLAYER_DIR
nimmer memory generate PLAYER_DIR [--seed N] [--entries N]
nimmer memory consolidate AGENT_DIR | mcp AGENT_DIR [--no-watch]
nimmer versions [--releases DIR] [--trusted-keys DIR] list | show V | verify V | promote V
nimmer versions pull URL_OR_PATH [--alias production | --no-alias] [--allow-downgrade]
nimmer keys generate PRIVATE_KEY [--trust DIR]
nimmer keys trust PUBLIC_KEY DIR
nimmer serve [--releases DIR] [--version production] [--host 127.0.0.1] [--port 8000] [--api-key-env VAR]
             [--reload-s 5] [--dtype float32|bfloat16|auto] [--stream-interval 4]
nimmer consent show PLAYER_DIR | set TIER PLAYER_DIR | revoke PLAYER_DIR | exclude CATEGORY PLAYER_DIR
nimmer llm-config show PLAYER_DIR | set PLAYER_DIR --player-id ID [--casual-ring R ...] [--key-stdin TIER]
nimmer contribute PLAYER_DIR --superlink HOST:PORT --root-certificates CA [--releases DIR] [--version V]
nimmer contributions [upload | forget] PLAYER_DIR [--intake URL]
nimmer federation certs DIR --host HOST | a2 add|status|forget --pool POOL ... | a2 serve --folder DIR
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
    if (folder / PRIMARY_FILE).exists():
        report["federation"] = _contributor_report(folder)
    return report


def show_version(releases: Path, name: str) -> dict[str, Any]:
    """Everything the registry holds about one version (``nimmer versions show``)."""
    from nimmer_train.publish.listing import privacy_report
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
        out["privacy"] = privacy_report(v.folder)  # guarantees, mechanism, epsilons, audit bound
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
    elif args.command == "pull":
        _pull(args, releases)
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


def _pull(args: argparse.Namespace, releases: Path) -> None:
    from nimmer_train.publish.pull import pull_version
    from nimmer_train.publish.signing import Keyring

    keyring = Keyring.load(args.trusted_keys or releases.parent / "keys" / "trusted")
    got = pull_version(releases, args.source, keyring, args.alias, allow_downgrade=args.allow_downgrade)
    moved = f"; {got.alias} -> {got.label}" if got.alias else ""
    if got.discarded:
        print(f"deleted from the staging folder, not in the manifest: {', '.join(got.discarded)}")
    if got.already:
        print(f"{got.label} is already here (signature OK, key {got.key_id}){moved}")
        return
    print(
        f"{'repaired' if got.repaired else 'pulled'} {got.label} into {releases}: signature OK "
        f"(key {got.key_id}), {got.files} files match their sha256; {got.fetched_bytes / 1e6:.1f} MB "
        f"fetched, {got.resumed_bytes / 1e6:.1f} MB resumed, {got.seconds:.2f} s{moved}"
    )


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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be 1 or more")
    return value


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from nimmer_train.runtime.local_model import EngineSettings, LocalModel
    from nimmer_train.runtime.openai_server import Reload, create_app, model_ids

    api_key = serve_api_key(args.host, args.api_key_env)
    settings = EngineSettings(dtype=args.dtype, stream_interval=args.stream_interval)
    trusted = args.trusted_keys or args.releases.parent / "keys" / "trusted"
    auth = " (bearer token required)" if api_key else ""

    def load() -> LocalModel:  # in a thread once the port is open: /health says 503 meanwhile
        model = LocalModel.open(args.releases, args.version, trusted, settings=settings)
        print(f"serving {', '.join(model_ids(model))} on http://{args.host}:{args.port}/v1{auth}", flush=True)
        return model

    # follow the alias: a version promoted (or pulled) while serving is swapped in, turns kept
    reload = (
        Reload.alias(args.releases, args.version, trusted, args.reload_s, settings)
        if args.reload_s > 0
        else None
    )
    app = create_app(load, api_key=api_key, adapter_updates=args.allow_adapter_updates, reload=reload)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
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
        if args.group in CONTRIBUTOR_GROUPS:
            return CONTRIBUTOR_GROUPS[args.group](args)
        if args.group == "llm-config":
            return _llm_config(args)
        return _memory(args)
    except NimmerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nimmer", description="nimmer-train device tools")
    groups = parser.add_subparsers(dest="group", required=True)
    _add_memory(groups)
    _add_versions(groups)
    _add_keys(groups)
    _add_serve(groups)
    _add_contributor(groups)
    _add_llm_config(groups)
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
    generate.add_argument(
        "--tier", default=None, help="consent tier (default opt_out, as the design; --append keeps it)"
    )
    generate.add_argument("--append", action="store_true", help="add entries to an existing player")
    generate.add_argument("--player-id", default=None, help="default: player-s<seed>")
    generate.add_argument("--player-name", default="Marta")
    consolidate_cmd = memory.add_parser(
        "consolidate", help="run one memory consolidation pass over an agent folder now"
    )
    consolidate_cmd.add_argument("agent_dir", type=Path)
    mcp_cmd = memory.add_parser("mcp", help="serve an agent folder's memory tools over MCP (stdio)")
    mcp_cmd.add_argument("agent_dir", type=Path)
    mcp_cmd.add_argument("--no-watch", action="store_true", help="do not watch the workspace files")


def _add_versions(groups: Any) -> None:
    versions = groups.add_parser(
        "versions", help="published nimmerworld base versions", parents=[_release_options(defaults=True)]
    )
    vcmd = versions.add_subparsers(dest="command", required=True)
    after = _release_options(defaults=False)  # the same options after the subcommand win
    vcmd.add_parser(
        "list", help="every version with epsilon, contributors, LoRAs and aliases", parents=[after]
    )
    for name, text in (
        ("show", "everything the registry holds about a version"),
        ("verify", "check the signature and every file's sha256"),
        ("promote", "point the production alias (registry and MLflow) at a version"),
    ):
        cmd = vcmd.add_parser(name, help=text, parents=[after])
        cmd.add_argument("version", help="vN, nimmerworld-base-vN, candidate or production")
        if name == "promote":
            cmd.add_argument("--alias", default="production")
    pull = vcmd.add_parser(
        "pull", help="fetch a version (resumable), verify it, register it here", parents=[after]
    )
    pull.add_argument("source", help="a version folder's http(s) URL or path (.../nimmerworld-base-vN)")
    pull.add_argument("--alias", default="production", help="point this alias at it (default: production)")
    pull.add_argument("--no-alias", dest="alias", action="store_const", const=None, help="only register it")
    pull.add_argument(
        "--allow-downgrade", action="store_true", help="let the alias move to an older version (a rollback)"
    )


def _release_options(defaults: bool) -> argparse.ArgumentParser:
    """``--releases`` and ``--trusted-keys``, accepted before and after a ``versions`` subcommand:
    the group's copy carries the defaults, the subcommands' copy only what the user typed."""
    options = argparse.ArgumentParser(add_help=False)
    unset = {"default": argparse.SUPPRESS}
    options.add_argument(
        "--releases",
        type=Path,
        **({"default": Path("releases")} if defaults else unset),
        help="default: ./releases",
    )
    options.add_argument(
        "--trusted-keys",
        type=Path,
        **({"default": None} if defaults else unset),
        help="default: RELEASES/../keys/trusted",
    )
    return options


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
    serve.add_argument(
        "--allow-adapter-updates",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (registry-listed LoRAs only)",
    )
    serve.add_argument(
        "--reload-s",
        type=float,
        default=5.0,
        help="resolve --version again every this many seconds and swap in the version it names "
        "now, finishing turns in flight on the old one (0: never; default 5)",
    )
    serve.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "auto"),
        default="float32",
        help="the weights' dtype while serving (auto: bfloat16 where the CPU has AMX or AVX512-BF16, "
        "or on a CUDA GPU with bfloat16; a seeded request may then differ alone and in a batch)",
    )
    serve.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=4,
        help="a streamed choice's text is sent every this many tokens, its first text at once "
        "(1: every token, at a cost to every running turn; default 4)",
    )


def _memory(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        if not args.player_dir.is_dir():
            print(f"error: no player folder at {args.player_dir}", file=sys.stderr)
            return 2
        print(json.dumps(inspect_player(args.player_dir), indent=2))
    elif args.command in ("consolidate", "mcp"):
        return _memory_agent(args)
    else:
        from nimmer_train.memory.embedding import SentenceEmbedder
        from nimmer_train.memory.synthetic import generate_player

        print(
            json.dumps(
                generate_player(
                    args.player_dir,
                    SentenceEmbedder(),
                    args.seed,
                    args.entries,
                    player_name=args.player_name,
                    player_id=args.player_id or f"player-s{args.seed}",
                    tier=args.tier,
                    append=args.append,
                ),
                indent=2,
            )
        )
    return 0


def _memory_agent(args: argparse.Namespace) -> int:
    """`nimmer memory consolidate|mcp AGENT_DIR` (issue 16's crystals)."""
    if not args.agent_dir.is_dir():
        print(f"error: no agent folder at {args.agent_dir}", file=sys.stderr)
        return 2
    if args.command == "mcp":
        from nimmer_train.agent.mcp_server import serve_stdio

        serve_stdio(args.agent_dir, watch=not args.no_watch)
        return 0
    from nimmer_train.agent.agent_memory import AgentMemory
    from nimmer_train.agent.scheduler import run_once
    from nimmer_train.memory.embedding import NoEmbedder

    agent = AgentMemory(args.agent_dir, NoEmbedder())  # consolidation reuses stored vectors
    try:
        report = run_once(agent)
    finally:
        agent.close()
    if report is None:
        print(f"error: a consolidation of {args.agent_dir} is running already; skipped", file=sys.stderr)
        return 3
    print(json.dumps(report, indent=2))
    return 0


# --- the contributor's and the operator's federation commands (issue 23) ---------------------


def _open_player(folder: Path) -> Any:
    from nimmer_train.memory.embedding import NoEmbedder
    from nimmer_train.memory.player_memory import PRIMARY_FILE, PlayerMemory

    if not (folder / PRIMARY_FILE).exists():
        raise NimmerError(
            f"no player at {folder} (no {PRIMARY_FILE}); `nimmer memory generate {folder}` makes one"
        )
    return PlayerMemory(folder, NoEmbedder())


def _stamp(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def _contributor_report(folder: Path) -> dict[str, Any]:
    """Tier, contributor id and privacy spend of a player (``nimmer memory inspect``)."""
    from nimmer_train.memory import contributions
    from nimmer_train.memory.consent import PROFILE_FILE, existing_contributor_id, get_consent, sent_uploads

    memory = _open_player(folder)
    try:
        record = get_consent(memory)
        ident, uploads = existing_contributor_id(memory), sent_uploads(memory)
    finally:
        memory.close()
    return {
        "tier": record.sharing_tier,
        "revoked_at": _stamp(record.revoked_at),
        "categories_shared": list(record.data_categories_shared),
        "categories_excluded": list(record.excluded_categories),
        "profile": "present" if (folder / PROFILE_FILE).exists() else "missing",
        "contributor_id": ident,
        "a2_uploads_sent": len(uploads),
        "spend": contributions.spend(folder),
    }


def _consent(args: argparse.Namespace) -> int:
    from nimmer_train.memory.consent import exclude, grant, revoke, takes_part, write_profile

    folder: Path = args.player_dir
    memory = _open_player(folder)
    try:
        if args.command == "set":
            if args.player_id or args.player_name:
                if not (args.player_id and args.player_name):
                    raise NimmerError("--player-id and --player-name go together: the profile needs both")
                write_profile(folder, args.player_id, args.player_name)
            grant(memory, args.tier, tuple(args.share) if args.share else None)
        elif args.command == "revoke":
            revoke(memory)
        elif args.command == "exclude":
            exclude(memory, args.category)
    finally:
        memory.close()
    report = _contributor_report(folder)
    memory = _open_player(folder)
    try:
        from nimmer_train.memory.consent import get_consent

        reason = takes_part(get_consent(memory))
    finally:
        memory.close()
    report["federated_rounds"] = "takes part" if reason is None else f"takes no part: {reason}"
    print(json.dumps({k: v for k, v in report.items() if k != "spend"}, indent=2))
    return 0


def _contributions(args: argparse.Namespace) -> int:
    from nimmer_train.memory import contributions

    action, folder = (
        (args.words[0], Path(args.words[1])) if len(args.words) == 2 else ("show", Path(args.words[0]))
    )
    if action == "show":
        _open_player(folder).close()
        log = contributions.entries(folder)
        if args.json:
            print(json.dumps(log, indent=2))
        else:
            print("\n".join(contributions.render(log)) or f"{folder}: nothing has left this device yet")
        return 0
    if action in ("upload", "forget") and args.intake:
        return _through_intake(action, folder, args.intake)
    if action == "upload":
        return _upload(folder, args.out)
    if action == "forget":
        return _forget(folder, args.out, args.answer)
    raise NimmerError(
        f"nimmer contributions {action}: unknown; use PLAYER_DIR, upload PLAYER_DIR or forget PLAYER_DIR"
    )


def _through_intake(action: str, folder: Path, url: str) -> int:
    """``contributions upload|forget PLAYER_DIR --intake URL``: through the operator's service."""
    from nimmer_train.federation.intake_service import IntakeClient, device_key, forget_through, send_uploads
    from nimmer_train.memory.consent import read_profile

    memory = _open_player(folder)
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
    from nimmer_train.federation.intake import write_upload
    from nimmer_train.memory.consent import a2_upload, read_profile

    if out is None:
        raise NimmerError("nimmer contributions upload needs --out DIR: where to write the upload file")
    player_id, player_name = read_profile(folder)
    memory = _open_player(folder)
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
    from nimmer_train.memory.deletion_requests import make_request, record_answer

    memory = _open_player(folder)
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


def _contribute(args: argparse.Namespace) -> int:
    from nimmer_train.federation.deploy import SuperNode, free_port, node_config, run_supernode
    from nimmer_train.memory.consent import contributor_id, get_consent, read_profile, takes_part
    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import open_version, verified_copy

    folder: Path = args.player_dir.resolve()
    memory = _open_player(folder)
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
    print(
        f"consent: A1_federated since {_stamp(record.granted_at)}, sharing "
        f"{', '.join(sorted(set(record.data_categories_shared) - set(record.excluded_categories)))}; "
        f"contributor id {ident} (stays on this device); only the masked update leaves it",
        flush=True,
    )
    if not args.root_certificates.is_file():
        raise NimmerError(
            f"--root-certificates {args.root_certificates}: no such file (the operator's ca.crt)"
        )
    keyring = Keyring.load(args.trusted_keys or args.releases.parent / "keys" / "trusted")
    version = open_version(args.releases, args.version, keyring)
    register = _register(version.loras, args.register, version.label)
    print(f"verified {version.label}: signature and every file's sha256; register {register}", flush=True)
    port = args.port or free_port(args.host)

    def still_takes_part() -> str | None:
        memory = _open_player(folder)
        try:
            return takes_part(get_consent(memory))
        finally:
            memory.close()

    with verified_copy(version) as copy:  # the SuperNode loads the very bytes verified
        node = SuperNode(
            args.superlink,
            args.root_certificates.resolve(),
            node_config(copy.folder, copy.loras[register], folder, args.superlink),
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


def _federation(args: argparse.Namespace) -> int:
    if args.command == "certs":
        from nimmer_train.federation.certs import make_certificates

        made = make_certificates(args.folder, args.host, args.days)
        print(
            f"{'reused' if made.ca_reused else 'new'} CA {made.ca} (give it to contributors; keep "
            f"{made.ca_key} offline); server certificate {made.server} and key {made.server_key} "
            f"for {', '.join(args.host)}"
        )
        return 0
    if args.a2_command == "serve":
        return _a2_serve(args)
    from nimmer_train.artifacts import write_json_atomic
    from nimmer_train.federation.intake import add_uploads, apply_deletion_request, pooled_ids
    from nimmer_train.privacy.a2_pool import pool_summary

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
    import uvicorn

    from nimmer_train.federation.intake_service import LOG_FILE, SERVER_LOGGING, local_app, log_to

    app = local_app(args.folder, args.k, args.pool, max_body=args.max_body)
    log_to(args.folder / LOG_FILE)
    pool = args.pool or args.folder / "a2_pool.sqlite"
    print(
        f"A.2 intake on http://{args.host}:{args.port} (k={args.k}); the pool for training: {pool}",
        flush=True,
    )
    uvicorn.run(app, host=args.host, port=args.port, **SERVER_LOGGING)
    return 0


CONTRIBUTOR_GROUPS = {
    "consent": _consent,
    "contributions": _contributions,
    "contribute": _contribute,
    "federation": _federation,
}


def _add_contributor(groups: Any) -> None:
    from nimmer_train.config.federated import FederatedConfig
    from nimmer_train.memory.consent import TIERS
    from nimmer_train.memory.entries import DATA_CATEGORIES

    consent = groups.add_parser(
        "consent", help="a player's consent to share data for training"
    ).add_subparsers(dest="command", required=True)
    consent.add_parser("show", help="tier, categories, revocation, profile").add_argument(
        "player_dir", type=Path
    )
    set_cmd = consent.add_parser("set", help="consent to a tier now (lifts a revocation)")
    set_cmd.add_argument("tier", choices=TIERS)
    set_cmd.add_argument("player_dir", type=Path)
    set_cmd.add_argument(
        "--share", nargs="+", choices=DATA_CATEGORIES, help="default: every shareable category"
    )
    set_cmd.add_argument("--player-id", default=None, help="writes the profile the device redacts with")
    set_cmd.add_argument("--player-name", default=None)
    consent.add_parser("revoke", help="share nothing from now on").add_argument("player_dir", type=Path)
    exclude = consent.add_parser("exclude", help="never share one data category")
    exclude.add_argument("category", choices=DATA_CATEGORIES)
    exclude.add_argument("player_dir", type=Path)

    log = groups.add_parser(
        "contributions",
        help="what left this device and what it cost; `upload` writes an A.2 upload, `forget` asks "
        "the operator to drop this device's A.2 uploads (or records the answer with --answer)",
    )
    log.add_argument("words", nargs="+", metavar="[upload|forget] PLAYER_DIR")
    log.add_argument("--json", action="store_true")
    log.add_argument("--out", type=Path, default=None, help="upload: a folder; forget: the request file")
    log.add_argument("--answer", type=Path, default=None, help="forget: the operator's answer file")
    log.add_argument("--intake", default=None, help="upload/forget through the operator's A.2 intake URL")

    contribute = groups.add_parser("contribute", help="join a federation: a Flower SuperNode for this player")
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

    federation = groups.add_parser("federation", help="the operator's side").add_subparsers(
        dest="command", required=True
    )
    certs = federation.add_parser("certs", help="a CA (reused if present) and the SuperLink's certificate")
    certs.add_argument("folder", type=Path)
    certs.add_argument("--host", action="append", required=True, help="a name or address of the SuperLink")
    certs.add_argument("--days", type=int, default=365)
    a2 = federation.add_parser("a2", help="the A.2 intake pool").add_subparsers(
        dest="a2_command", required=True
    )
    k = FederatedConfig().a2_k
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


def _add_llm_config(groups: Any) -> None:
    """``nimmer llm-config``: the player's player_llm_config row and sealed BYOK keys."""
    cmds = groups.add_parser("llm-config", help="the player's LLM tiers, rings and keys").add_subparsers(
        dest="command", required=True
    )
    cmds.add_parser("show", help="the row (keys as refs only)").add_argument("player_dir", type=Path)
    set_cmd = cmds.add_parser("set", help="set tiers' rings, providers, endpoints, models; seal a key")
    set_cmd.add_argument("player_dir", type=Path)
    set_cmd.add_argument("--player-id", required=True)
    for tier in ("casual", "deep"):
        for field in ("ring", "provider", "endpoint", "model"):
            set_cmd.add_argument(f"--{tier}-{field}", dest=f"{tier}_tier_{field}", default=None)
    set_cmd.add_argument("--lora-backup", choices=("on", "off"), default=None)
    set_cmd.add_argument(
        "--key-stdin", choices=("casual", "deep"), default=None, help="read that tier's API key from stdin"
    )


def _llm_config(args: argparse.Namespace) -> int:
    from nimmer_train.memory.llm_config import FIELDS, set_config, show

    if args.command == "show":
        print(json.dumps(show(args.player_dir), indent=2, sort_keys=True))
        return 0
    fields = {k: getattr(args, k) for k in FIELDS if getattr(args, k, None) is not None}
    if args.lora_backup is not None:
        fields["lora_backup_enabled"] = args.lora_backup == "on"
    keys = {args.key_stdin: sys.stdin.readline().strip()} if args.key_stdin else None
    row = set_config(args.player_dir, args.player_id, keys=keys, **fields)
    print(json.dumps(row, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
