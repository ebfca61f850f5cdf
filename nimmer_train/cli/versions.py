"""``nimmer versions``: the published nimmerworld base versions of a releases folder: list, show,
verify, promote, and pull one from elsewhere."""

from __future__ import annotations

import argparse
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from nimmer_train.cli.common import trusted_keys
from nimmer_train.errors import NimmerError
from nimmer_train.publish import mlflow_registry
from nimmer_train.publish.index import INDEX, NEWEST, VALIDITY_DAYS, write_index
from nimmer_train.publish.listing import print_versions, privacy_report
from nimmer_train.publish.manifest import SIGNATURE
from nimmer_train.publish.pull import is_version_location, pull_from_mirror, pull_version
from nimmer_train.publish.registry import REGISTRY_FILE, Registry
from nimmer_train.publish.signing import Keyring, load_private
from nimmer_train.publish.versions import verify_version


def register(parser: argparse.ArgumentParser) -> None:
    _release_options(parser, defaults=True)
    vcmd = parser.add_subparsers(dest="command", required=True)
    listing = vcmd.add_parser("list", help="every version with epsilon, contributors, LoRAs and aliases")
    _release_options(listing, defaults=False)  # the same options after the subcommand win
    for name, text in (
        ("show", "everything the registry holds about a version"),
        ("verify", "check the signature and every file's sha256"),
        ("promote", "point the production alias (registry and MLflow) at a version"),
    ):
        cmd = vcmd.add_parser(name, help=text)
        _release_options(cmd, defaults=False)
        cmd.add_argument("version", help="vN, nimmerworld-base-vN, candidate or production")
        if name == "promote":
            cmd.add_argument("--alias", default="production")
            cmd.add_argument(
                "--signing-key",
                type=Path,
                default=None,
                help=f"re-signs RELEASES/{INDEX} when there is one (default: RELEASES/../keys/publisher.key)",
            )
    index = vcmd.add_parser(
        "sign-index",
        help=f"re-sign RELEASES/{INDEX} (next sequence, fresh issued_at/expires_at); run it well within "
        "the validity so a live mirror never serves an expired index",
    )
    _release_options(index, defaults=False)
    index.add_argument(
        "--signing-key", type=Path, default=None, help="default: RELEASES/../keys/publisher.key"
    )
    index.add_argument(
        "--validity-days",
        type=float,
        default=None,
        help=f"how long this and later indexes stay valid (kept in the registry; default {VALIDITY_DAYS:g})",
    )
    pull = vcmd.add_parser("pull", help="fetch a version (resumable), verify it, register it here")
    _release_options(pull, defaults=False)
    pull.add_argument(
        "source",
        help="a version folder's http(s) URL or path (.../nimmerworld-base-vN), or a mirror's releases "
        f"folder (its signed {INDEX} names the versions: see --version)",
    )
    pull.add_argument(
        "--version",
        dest="select",
        default=None,
        help=f"from a mirror: {NEWEST}, an alias of the mirror's (production, candidate) or vN "
        "(default: production)",
    )
    pull.add_argument(
        "--alias",
        default="",
        help="point this alias here at it (default: production; none when following the mirror's candidate)",
    )
    pull.add_argument("--no-alias", dest="alias", action="store_const", const=None, help="only register it")
    pull.add_argument(
        "--allow-downgrade", action="store_true", help="let the alias move to an older version (a rollback)"
    )
    pull.add_argument(
        "--allow-expired-index",
        action="store_true",
        help="from a mirror: use its signed index past its expires_at (an offline copy you trust is "
        "current); every other check still runs",
    )
    pull.add_argument(
        "--accept-index-id",
        default=None,
        metavar="INDEX_ID",
        help="from a mirror: follow this index_id from now on, in place of the one pinned at the first "
        "pull (the publisher moved to a new releases folder)",
    )


def _release_options(options: argparse.ArgumentParser, defaults: bool) -> None:
    """``--releases`` and ``--trusted-keys``, accepted before and after a ``versions`` subcommand:
    the group's copy carries the defaults, the subcommands' copy only what the user typed."""
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


def run(args: argparse.Namespace) -> int:
    releases: Path = args.releases
    if args.command == "list":
        print_versions(releases)
    elif args.command == "show":
        print(json.dumps(show_version(releases, args.version), indent=2))
    elif args.command == "verify":
        _verify(args, releases)
    elif args.command == "pull":
        _pull(args, releases)
    elif args.command == "sign-index":
        index = write_index(
            releases, args.signing_key or releases.parent / "keys" / "publisher.key", args.validity_days
        )
        print(
            f"signed index {releases / INDEX}: sequence {index['sequence']}, issued {index['issued_at']}, "
            f"expires {index['expires_at']}; newest {index['newest']}"
        )
    else:
        _promote(args, releases)
    return 0


def show_version(releases: Path, name: str) -> dict[str, Any]:
    """Everything the registry holds about one version (``nimmer versions show``)."""
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


def _verify(args: argparse.Namespace, releases: Path) -> None:
    keyring = Keyring.load(trusted_keys(args))
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


def _promote(args: argparse.Namespace, releases: Path) -> None:
    signing_key = args.signing_key or releases.parent / "keys" / "publisher.key"
    if (releases / INDEX).exists():  # a mirror's releases: its signed index moves with the alias
        load_private(signing_key)  # the key is there before anything moves
    registry = Registry.open(releases)
    try:
        with registry.writing():
            version = registry.find(args.version)
            registry.set_alias(args.alias, version, datetime.now(UTC).isoformat(timespec="seconds"))
        print(f"{version.label} is now {args.alias!r} in {releases / REGISTRY_FILE}")
        uri = registry.setting("mlflow_tracking_uri")
        if uri:
            numbers = mlflow_registry.sync(registry, uri)
            print(f"MLflow: {mlflow_registry.BASE_MODEL}@{args.alias} -> version {numbers[version.label]}")
    finally:
        registry.close()
    if (releases / INDEX).exists():
        index = write_index(releases, signing_key)
        print(
            f"signed index {releases / INDEX}: sequence {index['sequence']}, {args.alias} -> {version.label}"
        )


def _pull(args: argparse.Namespace, releases: Path) -> None:
    keyring = Keyring.load(trusted_keys(args))
    if is_version_location(args.source):
        if args.select is not None:
            raise NimmerError(
                f"{args.source} is one version's folder; --version {args.select} picks a version from a "
                "mirror: give the mirror's releases folder (the URL or path above the version)"
            )
        alias = "production" if args.alias == "" else args.alias
        got = pull_version(releases, args.source, keyring, alias, allow_downgrade=args.allow_downgrade)
    else:
        select = args.select or "production"
        alias = args.alias if args.alias != "" else None if select == "candidate" else "production"
        index, got = pull_from_mirror(
            releases,
            args.source,
            select,
            keyring,
            alias,
            allow_downgrade=args.allow_downgrade,
            allow_expired=args.allow_expired_index,
            accept_index_id=args.accept_index_id,
        )
        print(
            f"the mirror's signed index (sequence {index['sequence']}, {index['issued_at']}, expires "
            f"{index.get('expires_at', 'never: signed before indexes expired')}): {select} is {got.label}"
        )
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
