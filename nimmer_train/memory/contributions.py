"""What left this device, and what it cost: the contributor's own log, beside the stores.

One JSON object per line in :data:`LOG_FILE` (appended and fsynced; it never leaves the
device). Kinds of entries:

- ``round``: an A.1 round this device trained in: the federation (the SuperLink it joined),
  the round, the tier, what left (only the masked update: ``left``), how many local examples
  it trained on (they stayed here), the device's own record-level epsilon of local DP-SGD, and
  the federation's user-level epsilon after the round (the server's ledger, computed here from
  the mechanism the server announces, with the same Opacus accountant), with delta;
- ``refused``: a round this device was asked into and refused (consent revoked or not A.1);
- ``a2_upload``: an anonymised upload sent to the operator's A.2 intake (its random id, the
  number of examples in it, and the event_uids of the entries it carried: they stay here, so no
  entry is ever uploaded twice);
- ``deletion_request`` and ``deletion_answer``: a request to forget the A.2 uploads, and the
  operator's answer (which ids the pool dropped).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

LOG_FILE = "contributions.jsonl"
KINDS = ("round", "refused", "a2_upload", "deletion_request", "deletion_answer")


def record(folder: Path, kind: str, **fields: Any) -> dict[str, Any]:
    """Append one entry (stamped ``at`` now unless given) and return it."""
    if kind not in KINDS:
        raise ValueError(f"unknown contributions entry kind {kind!r}; known: {', '.join(KINDS)}")
    entry = {"kind": kind, "at": fields.pop("at", None) or time.time(), **fields}
    line = (json.dumps(entry, sort_keys=True) + "\n").encode()
    fd = os.open(folder / LOG_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
        os.fsync(fd)
    finally:
        os.close(fd)
    return entry


def entries(folder: Path) -> list[dict[str, Any]]:
    """Every complete entry, oldest first (a line cut short by a crash is skipped)."""
    path = folder / LOG_FILE
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def a2_sent_entries(folder: Path) -> set[str]:
    """The event_uids of every entry an A.2 upload from this device already carried."""
    return {uid for e in entries(folder) if e["kind"] == "a2_upload" for uid in e.get("entries", ())}


def spend(folder: Path) -> dict[str, Any]:
    """The latest spend per federation: rounds trained and the last epsilons, with delta."""
    by_federation: dict[str, dict[str, Any]] = {}
    for e in entries(folder):
        if e["kind"] != "round":
            continue
        f = by_federation.setdefault(e["federation"], {"rounds": 0})
        f["rounds"] += 1
        f.update(
            last_round=e["round"],
            epsilon=e.get("epsilon"),
            epsilon_local=e.get("epsilon_local"),
            delta=e.get("delta"),
        )
    return by_federation


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def render(log: list[dict[str, Any]]) -> list[str]:
    """The log as lines a contributor reads (``nimmer contributions``)."""
    lines = []
    for e in log:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at"]))
        kind = e["kind"]
        if kind == "round":
            text = (
                f"round {e['round']} of {e['federation']} ({e['tier']}): left this device: {e['left']}; "
                f"{e['examples_used']} local examples trained on here; epsilon {_fmt(e.get('epsilon'))} "
                f"(federation, user-level, if this round is released), "
                f"{_fmt(e.get('epsilon_local'))} (this device's DP-SGD, record-level), delta {e['delta']:g}"
            )
        elif kind == "refused":
            text = f"round {e['round']} of {e['federation']}: refused, no update left ({e['reason']})"
        elif kind == "a2_upload":
            text = f"A.2 upload {e['upload_id']}: {e['examples']} anonymised examples sent to the intake"
        elif kind == "deletion_request":
            text = f"asked the operator to forget {len(e['upload_ids'])} A.2 upload(s): {e['request']}"
        else:
            text = (
                f"operator's answer: {len(e['deleted'])} upload(s) dropped from the A.2 pool"
                + (f", {len(e['unknown'])} not in it" if e.get("unknown") else "")
                + " (forward-only: already-released adapters keep what they learned)"
            )
        lines.append(f"{when}  {text}")
    return lines
