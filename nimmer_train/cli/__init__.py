"""The ``nimmer`` command: player stores on this device, published versions, signing keys.

nimmer memory inspect PLAYER_DIR
nimmer memory generate PLAYER_DIR [--seed N] [--entries N]
nimmer memory consolidate AGENT_DIR | mcp AGENT_DIR [--no-watch]
nimmer versions [--releases DIR] [--trusted-keys DIR] list | show V | verify V | promote V
nimmer versions pull URL_OR_PATH [--version newest|ALIAS|vN] [--alias A | --no-alias] [--allow-downgrade]
nimmer keys generate PRIVATE_KEY [--trust DIR]
nimmer keys trust PUBLIC_KEY DIR
nimmer serve [--releases DIR] [--version production] [--host 127.0.0.1] [--port 8000] [--api-key-env VAR]
             [--reload-s 5] [--dtype float32|bfloat16|auto] [--stream-interval 4]
nimmer consent show PLAYER_DIR | set TIER PLAYER_DIR | revoke PLAYER_DIR | exclude CATEGORY PLAYER_DIR
nimmer llm-config show PLAYER_DIR | set PLAYER_DIR --player-id ID [--casual-ring R ...] [--key-stdin TIER]
nimmer contribute PLAYER_DIR --superlink HOST:PORT --root-certificates CA [--releases DIR] [--version V]
nimmer contributions [upload | forget] PLAYER_DIR [--intake URL]
nimmer backup create DIR NAME | list DIR | restore DIR [NAME] --host URL | serve --folder HOST_DIR
nimmer federation certs DIR --host HOST | a2 add|status|forget --pool POOL ... | a2 serve --folder DIR

One module per command group: ``register`` gives the group's parser its subcommands, ``run`` runs
them. The player's device: memory, consent, contributions, contribute, llm_config, backup; the operator:
federation, keys; the publisher: versions, serve.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Collection
from types import ModuleType

from nimmer_train.errors import NimmerError

# command group -> its --help line and the module that registers and runs it, in the order --help
# lists them. A group's module (and torch, Flower, the web stacks behind it) is imported only when
# that group runs: `nimmer --help` imports none, `nimmer memory inspect` only memory's.
GROUPS: dict[str, tuple[str, str]] = {
    "memory": ("a player's local memory stores", "memory"),
    "versions": ("published nimmerworld base versions", "versions"),
    "keys": ("Ed25519 publisher keys", "keys"),
    "serve": ("an OpenAI-compatible server over a verified version (Ring B)", "serve"),
    "consent": ("a player's consent to share data for training", "consent"),
    "contributions": (
        "what left this device and what it cost; `upload` writes an A.2 upload, `forget` asks "
        "the operator to drop this device's A.2 uploads (or records the answer with --answer)",
        "contributions",
    ),
    "contribute": ("join a federation: a Flower SuperNode for this player", "contribute"),
    "federation": ("the operator's side", "federation"),
    "llm-config": ("the player's LLM tiers, rings and keys", "llm_config"),
    "backup": ("the player's LoRAs, sealed here and kept on the backup host", "backup"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    group = next((word for word in argv if not word.startswith("-")), None)  # nimmer has no options
    args = _parser(filled=[group] if group in GROUPS else []).parse_args(argv)
    try:
        return _module(args.group).run(args)
    except NimmerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _parser(filled: Collection[str] = GROUPS) -> argparse.ArgumentParser:
    """Every group, with the subcommands of those in ``filled`` (their modules imported)."""
    parser = argparse.ArgumentParser(prog="nimmer", description="nimmer-train device tools")
    groups = parser.add_subparsers(dest="group", required=True)
    for name, (text, _) in GROUPS.items():
        group = groups.add_parser(name, help=text)
        if name in filled:
            _module(name).register(group)
    return parser


def _module(group: str) -> ModuleType:
    return importlib.import_module(f"{__name__}.{GROUPS[group][1]}")
