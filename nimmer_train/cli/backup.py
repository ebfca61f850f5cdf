"""``nimmer backup``: the player's own LoRAs (``PLAYER_DIR/loras/<name>/``) sealed on this device
and kept on the backup host (``backup/player_loras.py``): create, list, restore; and ``serve``,
the operator's host (``backup/service.py`` under ``backup/serving.py``'s deadlines).

The passphrase (or, with ``--recovery-code``, a recovery code) is read from the terminal without
echo, or as the first line of stdin when it is not a terminal; it is never an argument."""

from __future__ import annotations

import argparse
import getpass
import sys
from pathlib import Path

import httpx

from nimmer_train.backup import player_loras
from nimmer_train.backup.sealing import BackupError
from nimmer_train.backup.service import BackupClient
from nimmer_train.cli.common import stamp


def register(parser: argparse.ArgumentParser) -> None:
    cmds = parser.add_subparsers(dest="command", required=True)
    create = cmds.add_parser("create", help="seal PLAYER_DIR/loras/NAME and upload it as its next version")
    create.add_argument("player_dir", type=Path)
    create.add_argument("name", help="the LoRA folder's name under PLAYER_DIR/loras/")
    create.add_argument("--recovery-codes", type=int, default=8, help="codes that also unlock it (default 8)")
    listing = cmds.add_parser("list", help="what the host holds for this device, and the local copies' state")
    listing.add_argument("player_dir", type=Path)
    restore = cmds.add_parser(
        "restore",
        help="download, verify, unseal into PLAYER_DIR/loras/NAME (no NAME: every missing or damaged)",
    )
    restore.add_argument("player_dir", type=Path)
    restore.add_argument("name", nargs="?", default=None)
    restore.add_argument("--version", type=int, default=None, help="that version (default: the newest)")
    restore.add_argument("--recovery-code", action="store_true", help="unlock with a recovery code")
    restore.add_argument(
        "--overwrite", action="store_true", help="replace a local copy that changed since its backup"
    )
    for cmd in (create, listing, restore):
        cmd.add_argument("--host", required=True, help="the backup host's URL (e.g. https://backup.example)")
    serve = cmds.add_parser("serve", help="the operator's backup host (ciphertext and metadata only)")
    serve.add_argument("--folder", type=Path, required=True, help="its SQLite metadata and blob files")
    serve.add_argument("--bind", default="127.0.0.1", help="the address to listen on (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8480)


def run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    try:
        client = player_loras.device_client(args.player_dir, args.host)
        if args.command == "create":
            return _create(args, client)
        if args.command == "list":
            return _list(args, client)
        return _restore(args, client)
    except httpx.HTTPError as exc:
        raise BackupError(
            f"the backup host {args.host} failed ({type(exc).__name__}: {exc}); try again"
        ) from exc


def _secret(prompt: str, confirm: bool = False) -> str:
    if not sys.stdin.isatty():
        return sys.stdin.readline().rstrip("\r\n")
    secret = getpass.getpass(prompt)
    if confirm and getpass.getpass("again: ") != secret:
        raise BackupError("the two passphrases differ; nothing was backed up")
    return secret


def _create(args: argparse.Namespace, client: BackupClient) -> int:
    passphrase = _secret("backup passphrase (a few words): ", confirm=True)
    made = player_loras.create(args.player_dir, args.name, client, passphrase, args.recovery_codes)
    print(
        f"backed up {made.name} v{made.version} (backup {made.backup_id}, {made.size_bytes} bytes, "
        f"{made.sealed_bytes} sealed) to {args.host} account {made.account}"
    )
    if made.recovery_codes:
        print("recovery codes (each also unlocks this backup; shown once, keep them offline):")
        print("\n".join(f"  {code}" for code in made.recovery_codes))
    print(
        f"restoring on another machine needs {args.player_dir / player_loras.KEY_FILE} (this device's "
        "backup account key): keep a copy with the codes"
    )
    return 0


def _list(args: argparse.Namespace, client: BackupClient) -> int:
    rows = player_loras.rows(client)
    print(f"backup account {client.account} on {args.host}: {len(rows)} backup(s)")
    for r in rows:
        print(
            f"  {r['lora_name']}  v{r['lora_version']}  {r['size_bytes']} B  {stamp(r['backed_up_at'])}  "
            f"{r['backup_id']}"
        )
    names = sorted({r["lora_name"] for r in rows} | set(_local_names(args.player_dir)))
    if names:
        print("here:")
    for name in names:
        print(f"  {name}: {player_loras.local_state(args.player_dir, name)}")
    return 0


def _local_names(player_dir: Path) -> list[str]:
    folder = player_dir / player_loras.LORAS
    return [p.name for p in folder.iterdir() if p.is_dir()] if folder.is_dir() else []


def _restore(args: argparse.Namespace, client: BackupClient) -> int:
    rows = player_loras.to_restore(args.player_dir, client, args.name)
    if args.version is not None:
        if args.name is None:
            raise BackupError("--version needs the LoRA's NAME")
        held = [r for r in client.list() if (r["lora_name"], r["lora_version"]) == (args.name, args.version)]
        if not held:
            raise BackupError(f"the backup host holds no {args.name} v{args.version} for this device")
        rows = held
    if not rows:
        print("every backed-up LoRA is here and loads; nothing to restore (name one to restore it anyway)")
        return 0
    for row in rows:
        state = player_loras.local_state(args.player_dir, row["lora_name"])
        if state.startswith(("changed since", "never backed up")) and not args.overwrite:
            raise BackupError(
                f"{row['lora_name']} here {state} and loads: restoring v{row['lora_version']} would "
                "replace what it learned since; pass --overwrite to replace it"
            )
    secret = _secret("recovery code: " if args.recovery_code else "backup passphrase: ")
    unlock = {"recovery_code": secret} if args.recovery_code else {"passphrase": secret}
    for row in rows:
        target = player_loras.restore(args.player_dir, client, row, **unlock)
        print(
            f"restored {row['lora_name']} v{row['lora_version']} ({row['backup_id']}) into {target}: verified"
        )
    return 0


def _serve(args: argparse.Namespace) -> int:
    from nimmer_train.backup.service import local_app
    from nimmer_train.backup.serving import serve

    app = local_app(args.folder)
    print(f"backup host on http://{args.bind}:{args.port}, storing in {args.folder}", flush=True)
    serve(app, args.bind, args.port, log_level="info", access_log=False)  # deadlines on slow clients
    return 0
