"""Consolidation: rescore, forget, purge, merge, TTL and stalled goals, each step one transaction.

Run every 30 minutes of (game) time by :mod:`nimmer_train.agent.scheduler` and on demand
(``nimmer memory consolidate``). Steps, per store (primary, and clasp when it exists):

1. rescore: the Ebbinghaus importance (importance.py) of every active crystal at ``now``
   (written back when it moved by more than ``rescore_tolerance`` or fell below the threshold);
2. forget: active, decaying crystals below the forget threshold -> expired (audited);
3. purge: crystals expired for longer than the retention period are deleted (audited);
4. merge: near-duplicates -> the less important one is archived into the other (cosine >=
   ``merge_threshold`` among live crystals of the same semantic type, by nearest neighbours,
   and not a "minimal pair" (:func:`minimal_pair`: the same sentence with one or two words
   swapped, "east gate" / "west gate", which MiniLM scores as high as a paraphrase),
   keeping provenance in ``merged_from`` and summing access counts). Only crystals not merge-
   checked yet are compared (against every live crystal), at most ``merge_batch`` per run, so a
   steady-state run compares the new arrivals only and a second run at the same ``now`` finds
   nothing (once the backlog fits one batch: a migrated store works through it run by run);
5. ttl: lifespan ``ttl`` crystals whose ttl has elapsed since valid_from -> expired;
6. stalled goals: live goal crystals without progress for ``stalled_goal_s`` get stalled_at.

A kill at any point leaves every committed step whole and the rest undone; a rerun finishes.
The clasp store is opened before any step: when another opener holds it (a server beside
``nimmer memory consolidate``), its steps are skipped and the report says so; primary's run
completes. The report is recorded per store: primary's part in primary, the clasp's in the clasp
store (primary, which a remote ring may be shown, never learns how the in-between was used).
Frozen crystals (skills) are never touched. Unlike Bitterbot, merge is not gated by a promote
threshold nor limited to one file (its merges almost never fired).

Hormones (issue 17, hormones.py) modulate a run through :func:`hormonal_policy`: cortisol
raises the merge threshold, and the decay resistance lengthens the Ebbinghaus half-life by
1 / (1 - resistance), multiplying with valence's own resistance rather than replacing it. Both are
relative to rest (an agent at rest consolidates exactly as without hormones) and are read at the
run's ``now``.
"""

from __future__ import annotations

import difflib
import json
import re
import time
from dataclasses import dataclass, replace

import numpy as np

from nimmer_train.agent import curiosity
from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.crystals import ACTIVE, audit, transition
from nimmer_train.agent.importance import NEVER_DECAY_CLASSES, ImportancePolicy, importance_many
from nimmer_train.agent.search import GONE
from nimmer_train.memory.clasp import ClaspBusy
from nimmer_train.memory.db import set_meta

DAY = 86400.0


@dataclass(frozen=True)
class ConsolidationPolicy:
    merge_threshold: float = 0.88  # calibrated for all-MiniLM-L6-v2 with the guard (docs/memory.md)
    neighbours: int = 10
    merge_batch: int = 2000  # unchecked crystals compared per run (oldest first); the rest next run
    rescore_tolerance: float = 1e-3
    retention_s: float = 30 * DAY
    stalled_goal_s: float = 7 * DAY
    interval_s: float = 1800.0
    importance: ImportancePolicy = ImportancePolicy()


DEFAULT_POLICY = ConsolidationPolicy()


def consolidate(
    agent: CrystalStore, now: float | None = None, policy: ConsolidationPolicy = DEFAULT_POLICY
) -> dict[str, object]:
    """One consolidation pass at ``now`` (the agent's clock by default); returns what changed."""
    now = agent.clock() if now is None else now
    policy = hormonal_policy(agent, now, policy)
    started = time.perf_counter()
    report: dict[str, object] = {"now": now}
    with agent.lock:
        stores = agent.existing_stores()
        if "clasp" in stores:
            try:
                agent.db("clasp")
            except ClaspBusy as exc:
                stores.remove("clasp")
                report["clasp"] = f"skipped: {exc}"
        for store in stores:
            report[store] = {
                "rescored": _rescore(agent, store, now, policy),
                "forgotten": _forget(agent, store, now, policy),
                "purged": _purge(agent, store, now, policy),
                "merged": _merge(agent, store, now, policy),
                "ttl_expired": _ttl(agent, store, now),
                "stalled_goals": _stalled_goals(agent, store, now, policy),
            }
        report["curiosity"] = curiosity.run(agent, now)  # regions rebuilt, targets refreshed
        report["wall_s"] = round(time.perf_counter() - started, 4)
        if "clasp" in stores:
            with agent.db("clasp"):
                set_meta(agent.db("clasp"), "last_consolidation_report", report["clasp"])
        db = agent.db("primary")
        with db:
            set_meta(db, "last_consolidation", now)
            set_meta(db, "consolidation_interval_s", policy.interval_s)
            set_meta(db, "last_consolidation_report", {k: v for k, v in report.items() if k != "clasp"})
    return report


def hormonal_policy(agent: CrystalStore, now: float, policy: ConsolidationPolicy) -> ConsolidationPolicy:
    """``policy`` as the agent's hormones modulate it at ``now`` (unchanged at rest)."""
    m = agent.hormones.modulation(now)
    if m.decay_resistance == 0.0 and m.merge_raise == 0.0:
        return policy
    half_life = policy.importance.half_life_s / (1.0 - m.decay_resistance)
    return replace(
        policy,
        merge_threshold=policy.merge_threshold + m.merge_raise,
        importance=replace(policy.importance, half_life_s=half_life),
    )


def _rescore(agent: CrystalStore, store: str, now: float, policy: ConsolidationPolicy) -> int:
    db = agent.db(store)
    rows = db.execute(
        "SELECT c.entry_id, e.semantic_type, e.access_count, coalesce(e.last_access, e.created_at), "
        "e.emotional_valence, e.importance, c.lifespan, e.memory_class, c.importance "
        f"FROM crystals c JOIN entries e ON e.id = c.entry_id WHERE c.lifecycle IN {ACTIVE}"
    ).fetchall()
    if not rows:
        return 0
    columns = list(zip(*rows, strict=True))
    decays = np.array(
        [
            lifespan != "permanent" and cls not in NEVER_DECAY_CLASSES
            for lifespan, cls in zip(columns[6], columns[7], strict=True)
        ]
    )
    values = importance_many(
        np.array(columns[1]),
        np.array(columns[2], dtype=np.float64),
        now - np.array(columns[3], dtype=np.float64),
        np.array(columns[4], dtype=np.float64),
        np.array(columns[5], dtype=np.float64),
        decays,
        policy.importance,
    )
    old = np.array(columns[8], dtype=np.float64)
    threshold = policy.importance.forget_threshold
    # stored importance weighs little in search: write it back when it moved by more than
    # rescore_tolerance, and always when it fell below the forget threshold (what forget reads)
    changed = np.flatnonzero(
        (np.abs(values - old) > policy.rescore_tolerance) | ((values < threshold) & (old >= threshold))
    )
    with db:
        db.executemany(
            "UPDATE crystals SET importance = ? WHERE entry_id = ?",
            [(float(values[i]), int(columns[0][i])) for i in changed],
        )
    agent.after_commit(store)
    return int(len(changed))


def _forget(agent: CrystalStore, store: str, now: float, policy: ConsolidationPolicy) -> int:
    ids = [
        r[0]
        for r in agent.db(store).execute(
            "SELECT c.entry_id FROM crystals c JOIN entries e ON e.id = c.entry_id "
            f"WHERE c.lifecycle IN {ACTIVE} AND c.lifespan = 'decay' AND e.memory_class NOT IN "
            f"{NEVER_DECAY_CLASSES} AND c.importance < ?",
            (policy.importance.forget_threshold,),
        )
    ]
    return agent.move(
        store, ids, "expired", f"forgotten: importance below {policy.importance.forget_threshold}"
    )


def _purge(agent: CrystalStore, store: str, now: float, policy: ConsolidationPolicy) -> int:
    db = agent.db(store)
    ids = [
        r[0]
        for r in db.execute(
            "SELECT entry_id FROM crystals WHERE lifecycle = 'expired' AND lifecycle_at <= ?",
            (now - policy.retention_s,),
        )
    ]
    if not ids:
        return 0
    with db:
        for entry_id in ids:
            audit(
                db, entry_id, now, "expired", "purged", f"expired for over {policy.retention_s / DAY:g} days"
            )
            db.execute("DELETE FROM entries_vec WHERE rowid = ?", (entry_id,))
            db.execute("DELETE FROM entries WHERE id = ?", (entry_id,))
    agent.index(store).remove(set(ids))
    if store in agent.memory._indexes:
        agent.memory._indexes[store].remove(set(ids))
    agent.after_commit(store)
    return len(ids)


def _merge(agent: CrystalStore, store: str, now: float, policy: ConsolidationPolicy) -> int:
    db = agent.db(store)
    index = agent.index(store)
    index._flush()
    live = {
        r[0]: r[1:]
        for r in db.execute(
            "SELECT c.entry_id, e.semantic_type, c.importance, c.merge_checked, e.memory_class "
            f"FROM crystals c JOIN entries e ON e.id = c.entry_id WHERE c.lifecycle IN {ACTIVE} "
            "AND c.valid_to IS NULL"
        )
    }
    unchecked = sorted(i for i, row in live.items() if row[2] == 0)[: policy.merge_batch]
    if not unchecked:
        return 0
    pairs: list[tuple[float, int, int]] = []
    kinds = {kind: n for n, kind in enumerate(sorted({row[0] for row in live.values()}))}
    codes = np.full(len(index.ids), -1, dtype=np.int16)  # the semantic type of each live row
    for entry_id, row in live.items():
        if entry_id in index.pos:
            codes[index.pos[entry_id]] = kinds[row[0]]
    queries = [i for i in unchecked if i in index.pos]
    step = max(1, min(1024, 2**24 // max(1, len(index.ids))))  # a block of sims stays <= 64 MB
    for start in range(0, len(queries), step):
        block = queries[start : start + step]
        at = np.array([index.pos[i] for i in block])
        sims = index.matrix[at] @ index.matrix.T  # against every row: no copy of the matrix
        rows, cols = np.nonzero(sims >= policy.merge_threshold)
        keep = (codes[cols] == codes[at][rows]) & (cols != at[rows])  # same type, live, not oneself
        for row, j in zip(rows[keep], cols[keep], strict=True):
            pairs.append((float(sims[row, j]), int(block[row]), int(index.ids[j])))
    near: dict[int, int] = {}  # at most ``neighbours`` partners per crystal, nearest first
    kept = []
    for sim, a, b in sorted(pairs, key=lambda p: (-p[0], p[1], p[2])):
        if near.get(a, 0) < policy.neighbours:
            near[a] = near.get(a, 0) + 1
            kept.append((sim, *sorted((a, b))))
    pairs = kept
    merged = 0
    gone: set[int] = set()
    candidates = sorted(set(pairs), key=lambda p: (-p[0], p[1], p[2]))
    involved = sorted({i for _, a, b in candidates for i in (a, b)})
    texts: dict[int, str] = {}
    for start in range(0, len(involved), 500):
        chunk = involved[start : start + 500]
        texts.update(
            db.execute(f"SELECT id, text FROM entries WHERE id IN ({', '.join('?' * len(chunk))})", chunk)
        )
    with db:
        for _sim, a, b in candidates:
            if a in gone or b in gone or live[a][3] != live[b][3] or minimal_pair(texts[a], texts[b]):
                continue
            winner, loser = (a, b) if live[a][1] >= live[b][1] else (b, a)  # older wins ties
            _absorb(db, winner, loser, now)
            gone.add(loser)
            merged += 1
        db.executemany("UPDATE crystals SET merge_checked = 1 WHERE entry_id = ?", [(i,) for i in unchecked])
    for loser in gone:
        index.set_state(loser, GONE)
    agent.after_commit(store)
    return merged


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower().replace("n't", " not"))


def minimal_pair(a: str, b: str) -> bool:
    """Whether ``b`` is ``a`` with one or two short substitutions (a different fact, not a
    paraphrase): every replaced span has at most 2 words and at least half the words align."""
    ta, tb = _tokens(a), _tokens(b)
    ops = difflib.SequenceMatcher(a=ta, b=tb, autojunk=False).get_opcodes()
    equal = sum(i2 - i1 for op, i1, i2, _, _ in ops if op == "equal")
    replaced = [(i2 - i1, j2 - j1) for op, i1, i2, j1, j2 in ops if op == "replace"]
    return (
        bool(replaced)
        and all(x <= 2 and y <= 2 for x, y in replaced)
        and equal >= 0.5 * max(len(ta), len(tb))
    )


def _absorb(db, winner: int, loser: int, now: float) -> None:  # noqa: ANN001 - an apsw connection
    (w_from, w_state), (l_from, l_count) = (
        db.execute("SELECT merged_from, lifecycle FROM crystals WHERE entry_id = ?", (winner,)).fetchone(),
        db.execute(
            "SELECT c.merged_from, e.access_count FROM crystals c JOIN entries e ON e.id = c.entry_id "
            "WHERE c.entry_id = ?",
            (loser,),
        ).fetchone(),
    )
    uid = dict(db.execute("SELECT id, event_uid FROM entries WHERE id IN (?, ?)", (winner, loser)))
    provenance = sorted(set(json.loads(w_from)) | set(json.loads(l_from)) | {uid[loser]})
    db.execute("UPDATE crystals SET merged_from = ? WHERE entry_id = ?", (json.dumps(provenance), winner))
    db.execute("UPDATE entries SET access_count = access_count + ? WHERE id = ?", (l_count, winner))
    db.execute("UPDATE crystals SET parent_uid = ? WHERE entry_id = ?", (uid[winner], loser))
    transition(db, loser, "archived", f"merged into {winner}", now)
    if w_state != "consolidated":
        transition(db, winner, "consolidated", f"absorbed {loser}", now)


def _ttl(agent: CrystalStore, store: str, now: float) -> int:
    ids = [
        r[0]
        for r in agent.db(store).execute(
            "SELECT entry_id FROM crystals WHERE lifespan = 'ttl' AND lifecycle NOT IN ('expired', 'frozen') "
            "AND valid_from + ttl_s <= ?",
            (now,),
        )
    ]
    return agent.move(store, ids, "expired", "ttl elapsed")


def _stalled_goals(agent: CrystalStore, store: str, now: float, policy: ConsolidationPolicy) -> int:
    db = agent.db(store)
    with db:
        db.execute(
            "UPDATE crystals SET stalled_at = ? WHERE stalled_at IS NULL AND valid_to IS NULL AND "
            f"lifecycle IN {ACTIVE} AND coalesce(last_progress_at, valid_from) <= ? AND entry_id IN "
            "(SELECT id FROM entries WHERE semantic_type = 'goal')",
            (now, now - policy.stalled_goal_s),
        )
        changed = db.changes()
    agent.after_commit(store)
    return changed
