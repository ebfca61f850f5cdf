"""What several command groups share: opening a player folder, a timestamp, the trusted keys."""

from __future__ import annotations

import argparse
from datetime import UTC, datetime
from pathlib import Path

from nimmer_train.errors import NimmerError
from nimmer_train.memory.embedding import NoEmbedder
from nimmer_train.memory.player_memory import PRIMARY_FILE, PlayerMemory


def open_player(folder: Path) -> PlayerMemory:
    """The player's store without an embedder (no command here embeds), or a clear error."""
    if not (folder / PRIMARY_FILE).exists():
        raise NimmerError(
            f"no player at {folder} (no {PRIMARY_FILE}); `nimmer memory generate {folder}` makes one"
        )
    return PlayerMemory(folder, NoEmbedder())


def stamp(at: float | None) -> str | None:
    return None if at is None else datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds")


def trusted_keys(args: argparse.Namespace) -> Path:
    """``--trusted-keys``, by default RELEASES/../keys/trusted."""
    return args.trusted_keys or args.releases.parent / "keys" / "trusted"
