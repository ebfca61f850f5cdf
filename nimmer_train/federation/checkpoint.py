"""Round checkpoints: the global adapter after the last completed round, beside the state that
names it, for the Flower server (:class:`ServerState`, ``state.json``) and the sweep simulator
(``simulation.json``) alike.

A round's arrays are written first, then the state that names them, then older arrays go: a
kill leaves the last complete round in place. A round's privacy spend is written ahead of its
release (:func:`write_ahead`, ``pending``), so a restart finds a round accounted but never adopted
and never re-runs it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.privacy.accounting import Ledger

STATE_FILE = "state.json"  # the server's round checkpoint, beside the arrays it names


def arrays_file(work: Path, done: int) -> Path:
    """The global adapter after round ``done`` (0: the start)."""
    return work / f"global-r{done:04d}.npz"


def save_round(work: Path, state_file: str, state: Any, done: int, arrays: list[np.ndarray]) -> None:
    """Round ``done``'s arrays, then ``state`` (a dataclass) naming them; older arrays go."""
    target = arrays_file(work, done)
    tmp = target.with_suffix(".tmp.npz")
    np.savez(tmp, *arrays)
    tmp.replace(target)
    write_json_atomic(work / state_file, asdict(state))
    for old in work.glob("global-r*.npz"):
        if old != target:
            old.unlink()


def load_arrays(work: Path, done: int) -> list[np.ndarray] | None:
    """The arrays saved after round ``done``; None when there are none."""
    path = arrays_file(work, done)
    if not path.exists():
        return None
    with np.load(path) as data:
        return [data[f"arr_{i}"] for i in range(len(data.files))]


def write_ahead(work: Path, state_file: str, state: Any, server_round: int, ledger: Ledger) -> None:
    """The round's spend on disk (``state.pending``, the ledger) before its release is adopted."""
    state.pending, state.ledger = server_round, asdict(ledger)
    write_json_atomic(work / state_file, asdict(state))


def ledger_of(
    saved: dict[str, Any], settings: FederatedConfig, budget: bool = True, where: str = "the ledger"
) -> Ledger:
    """The privacy ledger a checkpoint holds (empty on a fresh start); ``budget``: with the
    settings' epsilon budget (a run), else none (reading a finished one)."""
    limit = settings.epsilon_budget if budget else None
    return Ledger.from_dict(saved, settings.delta, limit, where) if saved else Ledger(settings.delta, limit)


@dataclass
class ServerState:
    """Everything a restarted server needs, written atomically after each round."""

    round: int = 0
    stopped: str | None = None
    initial_loss: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    # the A.2 pool's noised counts, released once when the rounds end (None: not yet)
    pool_counts: dict[str, Any] | None = None
    pending: int | None = None  # a round accounted in the ledger whose release was not yet adopted

    @classmethod
    def load(cls, work: Path) -> ServerState:
        path = work / STATE_FILE
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        data.pop("contributors", None)  # before issue 20 the server listed contributor ids; no more
        return cls(**data)

    def save(self, work: Path, arrays: list[np.ndarray]) -> None:
        save_round(work, STATE_FILE, self, self.round, arrays)

    def arrays(self, work: Path) -> list[np.ndarray] | None:
        return load_arrays(work, self.round)
