"""``nimmer memory``: a player's local stores (inspect, generate) and an agent folder's memory
(consolidate, mcp)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.scheduler import run_once
from nimmer_train.cli.consent import contributor_report
from nimmer_train.memory.companion import COMPANION_FILE, open_companion
from nimmer_train.memory.db import connect, integrity_ok
from nimmer_train.memory.embedding import NoEmbedder, SentenceEmbedder
from nimmer_train.memory.player_memory import PRIMARY_FILE
from nimmer_train.memory.sync import FALLBACK_FILE
from nimmer_train.memory.synthetic import generate_player


def register(parser: argparse.ArgumentParser) -> None:
    memory = parser.add_subparsers(dest="command", required=True)
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


def run(args: argparse.Namespace) -> int:
    if args.command == "inspect":
        if not args.player_dir.is_dir():
            print(f"error: no player folder at {args.player_dir}", file=sys.stderr)
            return 2
        print(json.dumps(inspect_player(args.player_dir), indent=2))
    elif args.command in ("consolidate", "mcp"):
        return _memory_agent(args)
    else:
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


def inspect_player(folder: Path) -> dict:
    """Counts by class and category, the last snapshot and integrity, for primary, fallback and
    companion. The clasp store is not inspected: nothing but in-between retrieval reads it."""
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
        report["federation"] = contributor_report(folder)
    return report


def _memory_agent(args: argparse.Namespace) -> int:
    """`nimmer memory consolidate|mcp AGENT_DIR` (issue 16's crystals)."""
    if not args.agent_dir.is_dir():
        print(f"error: no agent folder at {args.agent_dir}", file=sys.stderr)
        return 2
    if args.command == "mcp":
        # heavy: the MCP SDK (and its web stack) takes most of a second to import
        from nimmer_train.agent.mcp_server import serve_stdio

        serve_stdio(args.agent_dir, watch=not args.no_watch)
        return 0
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
