"""``nimmer llm-config``: the player's player_llm_config row (LLM tiers, rings, providers) and
its sealed BYOK keys."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from nimmer_train.memory.llm_config import FIELDS, set_config, show


def register(parser: argparse.ArgumentParser) -> None:
    cmds = parser.add_subparsers(dest="command", required=True)
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


def run(args: argparse.Namespace) -> int:
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
