"""What left this device, and what it cost: the contributor's own log, beside the stores.

One JSON object per line in :data:`LOG_FILE` (appended and fsynced; it never leaves the
device). Kinds of entries:

- ``round``: an A.1 round this device trained in: the federation (``federation_id``, the id the
  server keeps with its privacy ledger, and ``federation``, the SuperLink's address, for people),
  the round, the tier, what left (only the masked update: ``left``), how many local examples
  it trained on (they stayed here), the device's own record-level epsilon of local DP-SGD, and
  the federation's user-level epsilon should the round be released (the server's ledger,
  computed here from the mechanism the server announces, with the same Opacus accountant), with
  delta, and what the server said of its earlier rounds (``outcome``: the last round done and
  those not released);
- ``outcome``: the server's word on its rounds when the federation ended (``final``): which were
  not released, and the federation's user-level epsilon;
- ``published``: a signed published version's word on a federation this device trained in
  (recorded by ``nimmer contributions`` after the manifest's signature verified:
  ``publish/released_rounds.py``): its label, version id and manifest sha256, the rounds it
  released, the federation's last round in it and its A.1 epsilon with delta. It settles the
  rounds the server never spoke of (a device that left early, revoked or offline, never hears
  the outcome message), and never lowers what the server said: a round the server told released
  stays released, and the server's figures stay in the spend;
- ``refused``: a round this device was asked into and refused (consent revoked or not A.1);
- ``consent_granted`` and ``consent_revoked``: the player's consent changing (from then on the
  device takes part, or shares nothing);
- ``a2_upload``: an anonymised upload sent to the operator's A.2 intake (its random id, the
  number of examples in it, and the event_uids of the entries it carried: they stay here, so no
  entry is ever uploaded twice);
- ``deletion_request`` and ``deletion_answer``: a request to forget the A.2 uploads, and the
  operator's answer (which ids the pool dropped).

The spend (:func:`spend`) is kept per federation, keyed by its ``federation_id``: two
federations behind one SuperLink address are two ledgers. A log written before federation ids
(its rounds name only the address) is read as one federation per run of increasing round
numbers at that address (a ledger's rounds only increase, so a round number that does not is a
new federation); nothing in the file is rewritten.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

LOG_FILE = "contributions.jsonl"
KINDS = (
    "round",
    "outcome",
    "published",
    "refused",
    "consent_granted",
    "consent_revoked",
    "a2_upload",
    "deletion_request",
    "deletion_answer",
)


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


def federation_keys(log: list[dict[str, Any]]) -> list[str | None]:
    """The federation each entry belongs to (None for an entry of no federation): its
    ``federation_id``, or for an entry logged before federation ids its address and the run of
    increasing round numbers it falls in (``legacy:ADDRESS#N``)."""
    keys: list[str | None] = []
    legacy: dict[str, tuple[int, int]] = {}  # address -> (run number, last round seen)
    for e in log:
        if e.get("federation_id"):
            keys.append(str(e["federation_id"]))
        elif e["kind"] in ("round", "refused") and "federation" in e:
            run, last = legacy.get(e["federation"], (0, 0))
            run = run + 1 if int(e["round"]) <= last or run == 0 else run
            legacy[e["federation"]] = (run, int(e["round"]))
            keys.append(f"legacy:{e['federation']}#{run}")
        else:
            keys.append(None)
    return keys


RELEASED, NOT_RELEASED, PENDING, UNRECORDED = "released", "not_released", "pending", "not_recorded"


def published(log: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(federation id, round) -> the ``published`` entry of the first (lowest) version that
    released that round."""
    out: dict[tuple[str, int], dict[str, Any]] = {}
    for e in sorted((e for e in log if e["kind"] == "published"), key=lambda e: e["version_number"]):
        for r in e["rounds_released"]:
            out.setdefault((str(e["federation_id"]), int(r)), e)
    return out


def _published_done(log: list[dict[str, Any]]) -> dict[str, int]:
    """Federation id -> the last round a published version of it covers (its ``rounds_done``; its
    last released round when the manifest does not say: what came after is not known from it)."""
    done: dict[str, int] = {}
    for e in log:
        if e["kind"] == "published":
            released = [int(r) for r in e["rounds_released"]]
            last = max(released, default=0) if e.get("rounds_done") is None else int(e["rounds_done"])
            done[str(e["federation_id"])] = max(done.get(str(e["federation_id"]), 0), last)
    return done


def release_states(log: list[dict[str, Any]]) -> dict[tuple[str, int], str]:
    """(federation key, round) -> whether that round was released: released when a signed
    published version released it (``published``); else as the server told this device, in a
    later round's instructions or in the outcome it sends when the federation ends (a version
    never demotes a round the server released: its update went out in the next global model);
    else not released when a version covers the round and leaves it out. A round none has spoken
    of yet is pending; one logged before federation ids (and so before the server told
    outcomes) is not recorded."""
    done: dict[str, int] = {}
    unreleased: dict[str, set[int]] = {}
    for key, e in zip(federation_keys(log), log, strict=True):
        told = e.get("outcome") if e["kind"] == "round" else e if e["kind"] == "outcome" else None
        if key is None or not told:
            continue
        done[key] = max(done.get(key, 0), int(told.get("rounds_done", 0)))
        unreleased.setdefault(key, set()).update(int(r) for r in told.get("not_released", ()))
    states = {}
    in_version, covered = published(log), _published_done(log)
    for key, e in zip(federation_keys(log), log, strict=True):
        if e["kind"] != "round" or key is None:
            continue
        r = int(e["round"])
        if (key, r) in in_version:
            states[(key, r)] = RELEASED
        elif key.startswith("legacy:"):
            states[(key, r)] = UNRECORDED
        elif r <= done.get(key, 0):  # the server's word
            states[(key, r)] = NOT_RELEASED if r in unreleased.get(key, set()) else RELEASED
        elif r <= covered.get(key, 0):
            states[(key, r)] = NOT_RELEASED
        else:
            states[(key, r)] = PENDING
    return states


def spend(folder: Path) -> dict[str, Any]:
    """The spend per federation (keyed by federation id): rounds trained and how many of them
    were released, not released or are pending; ``epsilon``: the federation's user-level (A.1)
    epsilon after the last released round this device trained in (or the server's final figure,
    when it told one; a log from before release states counts every round as released), with
    delta; a signed published version's figure (``published``) counts beside the server's and the
    released rounds' own (the largest stands: a version never makes the spend smaller than what
    the server said) and names the version (``released_in``); ``epsilon_if_pending_released``:
    what it becomes should the pending rounds be released; ``epsilon_local``: this device's own
    record-level epsilon of local DP-SGD (one accountant for all federations)."""
    log = entries(folder)
    states = release_states(log)
    out: dict[str, dict[str, Any]] = {}
    for key, e in zip(federation_keys(log), log, strict=True):
        if key is None or e["kind"] not in ("round", "outcome", "published"):
            continue
        f = out.setdefault(
            key,
            {"federation": e.get("federation"), "rounds": 0, RELEASED: 0, NOT_RELEASED: 0, PENDING: 0},
        )
        f.setdefault("epsilon", None)
        if e["kind"] == "published":  # the signed figure over the federation's population
            f["released_in"] = f.get("released_in") or e["label"]
            if e.get("epsilon") is not None:
                f["epsilon"] = max(f["epsilon"] or 0.0, float(e["epsilon"]))
                f["delta"] = _larger(f.get("delta"), e.get("delta"))
            continue
        if e["kind"] == "outcome":  # the server's last word: a floor, whatever a version says
            if e.get("epsilon") is not None:
                f["epsilon"] = max(f["epsilon"] or 0.0, float(e["epsilon"]))
                f["delta"] = _larger(f.get("delta"), e.get("delta"))
            continue
        state = states[(key, int(e["round"]))]
        f["rounds"] += 1
        f[state] = f.get(state, 0) + 1
        f.update(last_round=e["round"], epsilon_local=e.get("epsilon_local"))
        f["delta"] = _larger(f.get("delta"), e.get("delta"))
        # a released round's own figure (the ledger's accountant, after that round) is a floor
        if state in (RELEASED, UNRECORDED) and e.get("epsilon") is not None:
            f["epsilon"] = max(f["epsilon"] or 0.0, float(e["epsilon"]))
        if state == PENDING and e.get("epsilon") is not None:
            f["epsilon_if_pending_released"] = float(e["epsilon"])
    return out


def _larger(a: float | None, b: float | None) -> float | None:
    """The larger delta (None: not said): the spend's (epsilon, delta) holds for every source only
    when both are the largest of theirs (a smaller delta claims a stronger guarantee)."""
    return b if a is None else a if b is None else max(float(a), float(b))


def spend_total(by_federation: dict[str, Any]) -> dict[str, Any]:
    """This device's running total over every federation it trained in: the user-level (A.1)
    epsilons and deltas summed (basic composition: an upper bound on the combined loss), with
    the pending rounds' figures where some are pending, and the device's record-level epsilon
    of local DP-SGD (its one accountant already spans every federation)."""
    released = [f for f in by_federation.values() if f.get("epsilon") is not None]
    pending = [f.get("epsilon_if_pending_released", f.get("epsilon")) for f in by_federation.values()]
    locals_ = [f["epsilon_local"] for f in by_federation.values() if f.get("epsilon_local") is not None]
    return {
        "federations": len(by_federation),
        "epsilon_a1_user_level_sum": sum(f["epsilon"] for f in released) if released else None,
        "delta_sum": sum(f.get("delta") or 0.0 for f in released) if released else None,
        "epsilon_a1_if_pending_released_sum": (
            sum(p for p in pending if p is not None)
            if any(f.get("epsilon_if_pending_released") is not None for f in by_federation.values())
            else None
        ),
        "epsilon_local": max(locals_) if locals_ else None,
    }


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _round_line(e: dict[str, Any], state: str, version: dict[str, Any] | None = None) -> str:
    federation = "A.1 user-level, the federation's"
    if version is not None:  # released as a signed published version says
        own, signed = e.get("epsilon"), version.get("epsilon")
        larger = (  # the round's own figure is a floor (spend): never shown lower than the server's
            f"; this round's own figure {_fmt(own)} is larger and counts"
            if own is not None and (signed is None or float(own) > float(signed))
            else ""
        )
        return (
            f"round {e['round']} of {e['federation']} ({e['tier']}): left this device: {e['left']}; "
            f"{e['examples_used']} local examples trained on here; round released in {version['label']} "
            f"(signed; its epsilon {_fmt(signed)}, A.1 user-level over the federation's "
            f"population, at delta {version.get('delta') or 0:g}{larger}); {_fmt(e.get('epsilon_local'))} "
            "(this device's DP-SGD, record-level)"
        )
    cost = {
        RELEASED: f"epsilon {_fmt(e.get('epsilon'))} ({federation}, round released)",
        NOT_RELEASED: "round not released: the federation spent nothing on it and published nothing of it",
        PENDING: f"epsilon {_fmt(e.get('epsilon'))} ({federation}, if this round is released)",
        UNRECORDED: f"epsilon {_fmt(e.get('epsilon'))} ({federation}; logged before release states, "
        "counted as released)",
    }[state]
    return (
        f"round {e['round']} of {e['federation']} ({e['tier']}): left this device: {e['left']}; "
        f"{e['examples_used']} local examples trained on here; {cost}; "
        f"{_fmt(e.get('epsilon_local'))} (this device's DP-SGD, record-level), delta {e['delta']:g}"
    )


def _line(e: dict[str, Any], state: str | None, version: dict[str, Any] | None = None) -> str:
    kind = e["kind"]
    if kind == "round":
        return _round_line(e, state or PENDING, version)
    if kind == "published":
        rounds = ", ".join(map(str, e["rounds_released"])) or "none"
        return (
            f"{e['label']} (signed by key {e['key_id']}) releases rounds {rounds} of {e['federation']} "
            f"(federation {e['federation_id']}): its epsilon {_fmt(e.get('epsilon'))} (A.1 user-level) "
            f"at delta {e.get('delta') or 0:g}"
        )
    if kind == "outcome":
        kept = ", ".join(map(str, e.get("not_released", ()))) or "none"
        return (
            f"{e['federation']} ended after round {e['rounds_done']}: rounds not released: {kept}; "
            f"its epsilon {_fmt(e.get('epsilon'))} (A.1 user-level) at delta {e.get('delta', 0):g}"
        )
    if kind == "refused":
        return f"round {e['round']} of {e['federation']}: refused, no update left ({e['reason']})"
    if kind == "consent_granted":
        if e["tier"] == "opt_out":
            return "consent set to opt_out: nothing is shared"
        return f"consent {e['tier']} granted: sharing {', '.join(e['shared']) or 'nothing'}"
    if kind == "consent_revoked":
        return "consent revoked: no round and no upload leaves this device from now on"
    if kind == "a2_upload":
        return f"A.2 upload {e['upload_id']}: {e['examples']} anonymised examples sent to the intake"
    if kind == "deletion_request":
        return f"asked the operator to forget {len(e['upload_ids'])} A.2 upload(s): {e['request']}"
    return (
        f"operator's answer: {len(e['deleted'])} upload(s) dropped from the A.2 pool"
        + (f", {len(e['unknown'])} not in it" if e.get("unknown") else "")
        + " (forward-only: already-released adapters keep what they learned)"
    )


def render(log: list[dict[str, Any]]) -> list[str]:
    """The log as lines a contributor reads (``nimmer contributions``); a round says whether it
    was released, as far as the server has told."""
    states, in_version = release_states(log), published(log)
    lines = []
    for key, e in zip(federation_keys(log), log, strict=True):
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(e["at"]))
        where = (key, int(e["round"])) if key and e["kind"] == "round" else None
        state = states.get(where) if where else None
        lines.append(f"{when}  {_line(e, state, in_version.get(where) if where else None)}")
    return lines


def render_spend(by_federation: dict[str, Any]) -> list[str]:
    """The spend per federation and the running total, as ``nimmer contributions`` ends."""
    lines = []
    for key, f in by_federation.items():
        signed = f" (released in {f['released_in']}, signed)" if f.get("released_in") else ""
        pending = (
            f"; {f[PENDING]} pending (epsilon {_fmt(f['epsilon_if_pending_released'])} if released)"
            if f.get("epsilon_if_pending_released") is not None
            else ""
        )
        old = (
            f", {f[UNRECORDED]} logged before release states (counted as released)"
            if f.get(UNRECORDED)
            else ""
        )
        lines.append(
            f"spend in {f['federation']} (federation {key}): {f['rounds']} round(s) trained, "
            f"{f[RELEASED]} released{signed}, {f[NOT_RELEASED]} not released{old}; "
            f"epsilon {_fmt(f['epsilon'])} (A.1 user-level) at delta {f.get('delta') or 0:g}{pending}"
        )
    if by_federation:
        t = spend_total(by_federation)
        lines.append(
            f"total over {t['federations']} federation(s): epsilon {_fmt(t['epsilon_a1_user_level_sum'])} "
            f"(A.1 user-level, summed: basic composition) at delta {t['delta_sum'] or 0:g}; "
            f"this device's DP-SGD {_fmt(t['epsilon_local'])} (record-level)"
        )
    return lines


def record_published(folder: Path, claims: list[Any]) -> list[dict[str, Any]]:
    """Append a ``published`` entry for each verified version's word (``claims``: objects like
    ``publish.released_rounds.FederationRelease``) on a federation this device trained in, once
    per version and manifest; returns the entries added. The caller verified each signature."""
    log = entries(folder)
    mine = {
        str(e["federation_id"]): e["federation"]
        for e in log
        if e["kind"] == "round" and e.get("federation_id")
    }
    have = {(e["version_id"], e["manifest_sha256"]) for e in log if e["kind"] == "published"}
    added = []
    for c in claims:
        if c.federation_id not in mine or (c.version_id, c.manifest_sha256) in have:
            continue
        have.add((c.version_id, c.manifest_sha256))
        added.append(
            record(
                folder,
                "published",
                federation_id=c.federation_id,
                federation=mine[c.federation_id],
                label=c.label,
                version_number=c.version_number,
                version_id=c.version_id,
                manifest_sha256=c.manifest_sha256,
                key_id=c.key_id,
                rounds_released=list(c.rounds_released),
                rounds_done=c.rounds_done,
                epsilon=c.epsilon_a1_user_level,
                delta=c.delta,
            )
        )
    return added
