"""``nimmer consent``: a player's consent to share data for training, and the report of it that
``nimmer memory inspect`` shows too (issue 23)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from nimmer_train.cli.common import open_player, stamp
from nimmer_train.errors import NimmerError
from nimmer_train.memory import contributions
from nimmer_train.memory.consent import (
    PROFILE_FILE,
    TIERS,
    consent_view,
    exclude,
    existing_contributor_id,
    get_consent,
    grant,
    revoke,
    sent_uploads,
    takes_part,
    write_profile,
)
from nimmer_train.memory.entries import DATA_CATEGORIES


def register(parser: argparse.ArgumentParser) -> None:
    consent = parser.add_subparsers(dest="command", required=True)
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
    exclude_cmd = consent.add_parser("exclude", help="never share one data category")
    exclude_cmd.add_argument("category", choices=DATA_CATEGORIES)
    exclude_cmd.add_argument("player_dir", type=Path)


def run(args: argparse.Namespace) -> int:
    folder: Path = args.player_dir
    memory = open_player(folder)
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
    report = contributor_report(folder)
    memory = open_player(folder)
    try:
        reason = takes_part(get_consent(memory))
    finally:
        memory.close()
    report["federated_rounds"] = "takes part" if reason is None else f"takes no part: {reason}"
    print(json.dumps({k: v for k, v in report.items() if not k.startswith("spend")}, indent=2))
    return 0


def contributor_report(folder: Path) -> dict[str, Any]:
    """Tier, categories (as the consent filter enforces them), contributor id and privacy spend
    of a player, per federation and in total (``nimmer memory inspect``)."""
    memory = open_player(folder)
    try:
        record = get_consent(memory)
        ident, uploads = existing_contributor_id(memory), sent_uploads(memory)
    finally:
        memory.close()
    spend = contributions.spend(folder)
    return {
        "tier": record.sharing_tier,
        "revoked_at": stamp(record.revoked_at),
        **consent_view(record),
        "profile": "present" if (folder / PROFILE_FILE).exists() else "missing",
        "contributor_id": ident,
        "a2_uploads_sent": len(uploads),
        "spend": spend,
        "spend_total": contributions.spend_total(spend),
    }
