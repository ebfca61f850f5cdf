"""The scratch file ``memory/scratch.md``: one working_memory_note per line, written by
:func:`nimmer_train.agent.agent_memory.working_memory_note` and read back one crystal per line by
ingestion. The format lives here, below both, so the writer and the reader cannot drift."""

from __future__ import annotations

import datetime as dt
import re

from nimmer_train.agent.crystals import CrystalSpec, content_hash
from nimmer_train.errors import NimmerError

SCRATCH = "memory/scratch.md"
NOTE_TYPES = {
    "experience": "episode",
    "directive": "preference",
    "world_fact": "fact",
    "mental_model": "insight",
}


def _iso(at: float) -> str:
    return dt.datetime.fromtimestamp(at, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def scratch_line(at: float, note: str, importance_: float, kind: str) -> str:
    """One scratch.md line; :func:`note_spec` reads it back."""
    flat = " ".join(note.split())
    return f"- [{_iso(at)}] (importance: {importance_:.2f}, type: {kind}) {flat}"


def note_spec(line: str, path: str | None, line_no: int | None, now: float | None = None) -> CrystalSpec:
    """The crystal of one scratch line (see :func:`scratch_line`)."""
    match = re.match(r"- \[([^\]]+)\] \(importance: ([0-9.]+), type: (\w+)\) (.*)$", line)
    if match is None:
        raise NimmerError(f"{path}:{line_no}: not a scratch note line")
    kind = match.group(3) if match.group(3) in NOTE_TYPES else "experience"
    at = dt.datetime.strptime(match.group(1), "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()
    return CrystalSpec(
        text=match.group(4),
        origin="note",
        semantic_type=NOTE_TYPES[kind],
        path=path,
        start_line=line_no,
        end_line=line_no,
        importance=min(1.0, float(match.group(2))),
        directive=kind == "directive",
        valid_from=at if now is None else now,
        source_hash=content_hash(line),
    )
