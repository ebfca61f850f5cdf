"""The ``nimmer`` command: inspect and generate player stores on this device.

nimmer memory inspect PLAYER_DIR
nimmer memory generate PLAYER_DIR [--seed N] [--entries N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path


def inspect_player(folder: Path) -> dict:
    """Counts by class and category, the last snapshot and integrity, for primary, fallback and
    companion. The clasp store is not inspected: nothing but in-between retrieval reads it."""
    from nimmer_train.memory.companion import COMPANION_FILE, open_companion
    from nimmer_train.memory.db import connect, integrity_ok
    from nimmer_train.memory.store import PRIMARY_FILE
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nimmer", description="nimmer-train device tools")
    groups = parser.add_subparsers(dest="group", required=True)
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
    args = parser.parse_args(argv)
    if args.command == "inspect":
        if not args.player_dir.is_dir():
            print(f"error: no player folder at {args.player_dir}", file=sys.stderr)
            return 2
        print(json.dumps(inspect_player(args.player_dir), indent=2))
    else:
        from nimmer_train.embedding import SentenceEmbedder
        from nimmer_train.memory.synthetic import generate_player

        print(
            json.dumps(
                generate_player(args.player_dir, SentenceEmbedder(), args.seed, args.entries), indent=2
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
