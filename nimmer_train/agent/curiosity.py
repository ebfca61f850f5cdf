"""The curiosity engine: knowledge regions over the crystal embeddings and the targets that say
where the agent's knowledge is thin (they steer the dream engine's exploration).

Regions: greedy single-pass clustering of the ``top`` most important live crystals of the primary
store (cosine >= ``region_threshold`` to a running centroid, at least ``min_region`` members, at
most ``max_regions``). Region ids are stable across rebuilds: a new cluster takes the id of the old
region whose members it shares most (Jaccard >= ``keep_id_jaccard``) or whose centroid it matches
(cosine >= ``keep_id_cosine``); only a truly new cluster gets a new id (a hash of its members).
Bitterbot rebuilt regions with fresh ids, so its targets pointed at regions that no longer existed.

Targets (at most ``max_targets`` active by priority, ``ttl_s`` = 48 h to live, one per kind and
key):

- knowledge_gap (0.7): at least ``gap_searches`` searches since the last gap check whose top
  similarity was below ``gap_score`` (or found nothing), read from ``memory_search_log``;
- stale_region (0.5): a region of more than 5 crystals none of which was written or accessed for
  ``stale_s``;
- contradiction (0.8): two live crystals that fill the same slot ("<subject> lives in", "<subject>
  is", ...) with different values;
- frontier (0.6): at least 2 recent crystals far from every region (novelty 1 - max cosine to a
  centroid > ``frontier_novelty``).

Everything is kept in the primary store's ``memory_meta`` (keys ``curiosity_regions``,
``curiosity_targets``, ``curiosity_search_mark``), written in one transaction per rebuild, and every
time comes from the caller's ``now``. :func:`run` is called by consolidation.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.crystals import ACTIVE
from nimmer_train.errors import NimmerError
from nimmer_train.memory.db import get_meta, set_meta

HOUR = 3600.0
PRIORITY = {"contradiction": 0.8, "knowledge_gap": 0.7, "frontier": 0.6, "stale_region": 0.5}
KINDS = tuple(PRIORITY)
_SLOT = re.compile(
    r"^(?P<slot>.{2,60}?\b(?:lives in|lives at|works at|works as|is from|is married to|prefers|"
    r"favou?rite \w+ is|is called|is named))\s+(?P<value>[^.!?]{1,60})",
    re.I,
)


@dataclass(frozen=True)
class CuriosityPolicy:
    region_threshold: float = 0.7
    min_region: int = 3
    max_regions: int = 50
    top: int = 500  # crystals clustered, by importance
    keep_id_jaccard: float = 0.5
    keep_id_cosine: float = 0.9
    gap_searches: int = 3
    gap_score: float = 0.5
    stale_s: float = 7 * 24 * HOUR
    frontier_novelty: float = 0.7
    frontier_recent_s: float = 48 * HOUR
    max_targets: int = 10
    ttl_s: float = 48 * HOUR


DEFAULT_CURIOSITY = CuriosityPolicy()


def _unit(v: np.ndarray) -> np.ndarray:
    n = float(np.linalg.norm(v))
    return v / n if n else v


def cluster(vectors: np.ndarray, threshold: float) -> list[list[int]]:
    """Greedy single pass in row order: each row joins the most similar running centroid at
    cosine >= ``threshold`` or starts a new cluster; returns row indices per cluster."""
    centroids: list[np.ndarray] = []
    sums: list[np.ndarray] = []
    members: list[list[int]] = []
    for row, vec in enumerate(vectors):
        if centroids:
            sims = np.stack(centroids) @ vec
            best = int(np.argmax(sims))
            if sims[best] >= threshold:
                members[best].append(row)
                sums[best] = sums[best] + vec
                centroids[best] = _unit(sums[best])
                continue
        centroids.append(_unit(vec.astype(np.float64)))
        sums.append(vec.astype(np.float64))
        members.append([row])
    return members


def rebuild_regions(
    agent: CrystalStore, now: float, policy: CuriosityPolicy = DEFAULT_CURIOSITY
) -> list[dict[str, Any]]:
    """The regions at ``now`` with ids carried over from the previous build (not yet saved)."""
    db = agent.db("primary")
    rows = db.execute(
        "SELECT e.id, e.event_uid, max(e.created_at, coalesce(e.last_access, 0)) FROM crystals c "
        f"JOIN entries e ON e.id = c.entry_id WHERE c.lifecycle IN {ACTIVE} AND c.valid_to IS NULL "
        "AND e.semantic_type != 'insight' ORDER BY c.importance DESC, e.id LIMIT ?",
        (policy.top,),
    ).fetchall()
    index = agent.index("primary")
    kept = [(r, index.vector(r[0])) for r in rows]
    kept = [(r, v) for r, v in kept if v is not None]
    if not kept:
        return []
    vectors = np.stack([v for _, v in kept]).astype(np.float64)
    groups = [g for g in cluster(vectors, policy.region_threshold) if len(g) >= policy.min_region]
    groups.sort(key=lambda g: (-len(g), g[0]))
    old = {r["id"]: r for r in get_meta(db, "curiosity_regions", []) or []}  # type: ignore[union-attr]
    taken: set[str] = set()
    regions = []
    for group in groups[: policy.max_regions]:
        uids = sorted(kept[i][0][1] for i in group)
        centroid = _unit(vectors[group].mean(axis=0))
        rid = _match(set(uids), centroid, old, taken, policy)
        if rid is None:
            rid = "region-" + hashlib.sha256("\n".join(uids).encode()).hexdigest()[:12]
        taken.add(rid)
        before = old.get(rid)
        regions.append(
            {
                "id": rid,
                "size": len(uids),
                "members": uids,
                "centroid": [round(float(x), 6) for x in centroid],
                "created_at": before["created_at"] if before else now,
                "last_activity": max(float(kept[i][0][2]) for i in group),
                "example": _text(agent, kept[group[0]][0][0]),
            }
        )
    return regions


def _match(
    uids: set[str], centroid: np.ndarray, old: dict[str, dict], taken: set[str], policy: CuriosityPolicy
) -> str | None:
    best, best_score = None, 0.0
    for rid, region in sorted(old.items()):
        if rid in taken:
            continue
        members = set(region["members"])
        jaccard = len(uids & members) / max(1, len(uids | members))
        if jaccard >= policy.keep_id_jaccard and jaccard > best_score:
            best, best_score = rid, jaccard
    if best is not None:
        return best
    for rid, region in sorted(old.items()):
        if rid not in taken and float(np.dot(centroid, region["centroid"])) >= policy.keep_id_cosine:
            return rid
    return None


def _text(agent: CrystalStore, entry_id: int) -> str:
    row = agent.db("primary").execute("SELECT text FROM entries WHERE id = ?", (entry_id,)).fetchone()
    return row[0][:120] if row else ""


def _target(
    kind: str, key: str, description: str, now: float, policy: CuriosityPolicy, **detail: Any
) -> dict:
    tid = f"{kind}-" + hashlib.sha256(f"{kind}\n{key}\n{now}".encode()).hexdigest()[:10]
    return {
        "id": tid,
        "kind": kind,
        "key": key,
        "description": description,
        "priority": PRIORITY[kind],
        "created_at": now,
        "expires_at": now + policy.ttl_s,
        "resolved_at": None,
        "explored_at": None,
        **detail,
    }


def _gaps(agent: CrystalStore, now: float, policy: CuriosityPolicy) -> tuple[list[dict], int]:
    db = agent.db("primary")
    mark = int(get_meta(db, "curiosity_search_mark", 0))  # type: ignore[arg-type]
    rows = db.execute(
        "SELECT id, query, top_similarity FROM memory_search_log WHERE id > ? AND at <= ? ORDER BY id",
        (mark, now),
    ).fetchall()
    new_mark = max([mark] + [r[0] for r in rows])
    low = [r for r in rows if r[2] is None or r[2] < policy.gap_score]
    if len(low) < policy.gap_searches:
        return [], mark  # keep counting: the next low searches add to these
    queries = [r[1] for r in low]
    key = hashlib.sha256("\n".join(queries).encode()).hexdigest()[:12]
    described = "; ".join(q[:60] for q in queries[:5])
    return [
        _target("knowledge_gap", key, f"searches found little: {described}", now, policy, queries=queries)
    ], new_mark


def _contradictions(agent: CrystalStore, now: float, policy: CuriosityPolicy) -> list[dict]:
    slots: dict[str, dict[str, str]] = {}
    for uid, text in agent.db("primary").execute(
        "SELECT e.event_uid, e.text FROM crystals c JOIN entries e ON e.id = c.entry_id "
        f"WHERE c.lifecycle IN {ACTIVE} AND c.valid_to IS NULL AND e.semantic_type != 'insight' ORDER BY e.id"
    ):
        match = _SLOT.match(text.strip())
        if match:
            slot = " ".join(match.group("slot").lower().split())
            slots.setdefault(slot, {}).setdefault(" ".join(match.group("value").lower().split()), uid)
    out = []
    for slot, values in sorted(slots.items()):
        if len(values) > 1:
            shown = " / ".join(sorted(values))
            out.append(
                _target(
                    "contradiction",
                    slot,
                    f"'{slot}' has {len(values)} values: {shown}",
                    now,
                    policy,
                    sources=sorted(values.values()),
                )
            )
    return out


def _stale(regions: list[dict], now: float, policy: CuriosityPolicy) -> list[dict]:
    return [
        _target("stale_region", r["id"], f"nothing new about: {r['example']}", now, policy, region_id=r["id"])
        for r in regions
        if r["size"] > 5 and now - r["last_activity"] > policy.stale_s
    ]


def _frontier(agent: CrystalStore, regions: list[dict], now: float, policy: CuriosityPolicy) -> list[dict]:
    if not regions:
        return []
    rows = (
        agent.db("primary")
        .execute(
            "SELECT e.id, e.event_uid FROM crystals c JOIN entries e ON e.id = c.entry_id "
            f"WHERE c.lifecycle IN {ACTIVE} AND c.valid_to IS NULL AND e.semantic_type != 'insight' "
            "AND e.created_at >= ? ORDER BY e.id DESC LIMIT 200",
            (now - policy.frontier_recent_s,),
        )
        .fetchall()
    )
    index = agent.index("primary")
    centroids = np.array([r["centroid"] for r in regions])
    novel = []
    for entry_id, uid in rows:
        vec = index.vector(entry_id)
        if vec is not None and 1.0 - float(np.max(centroids @ vec)) > policy.frontier_novelty:
            novel.append(uid)
    if len(novel) < 2:
        return []
    key = hashlib.sha256("\n".join(sorted(novel)).encode()).hexdigest()[:12]
    return [
        _target(
            "frontier", key, f"{len(novel)} new memories fit no known region", now, policy, sources=novel[:10]
        )
    ]


def run(agent: CrystalStore, now: float, policy: CuriosityPolicy = DEFAULT_CURIOSITY) -> dict[str, int]:
    """Rebuild regions, expire old targets, detect new ones (deduplicated), keep the top
    ``max_targets`` active; one transaction. Returns counts."""
    with agent.lock:
        db = agent.db("primary")
        regions = rebuild_regions(agent, now, policy)
        targets: list[dict] = list(get_meta(db, "curiosity_targets", []) or [])  # type: ignore[arg-type]
        expired = 0
        for t in targets:
            if t.get("resolved_at") is None and t.get("expired_at") is None and now >= t["expires_at"]:
                t["expired_at"] = now
                expired += 1
        open_keys = {(t["kind"], t["key"]) for t in targets if _open(t)}
        gaps, mark = _gaps(agent, now, policy)
        found = gaps + _contradictions(agent, now, policy) + _stale(regions, now, policy)
        found += _frontier(agent, regions, now, policy)
        added = [t for t in found if (t["kind"], t["key"]) not in open_keys]
        targets += added
        active = sorted(
            (t for t in targets if _open(t)), key=lambda t: (-t["priority"], t["created_at"], t["id"])
        )
        dropped = 0
        for t in active[policy.max_targets :]:
            t["expired_at"], dropped = now, dropped + 1  # over the cap: the least urgent go
        # keep the closed ones for a day of history, then forget them
        targets = [t for t in targets if _open(t) or now - _closed_at(t) < 24 * HOUR]
        with db:
            set_meta(db, "curiosity_regions", regions)
            set_meta(db, "curiosity_targets", targets)
            set_meta(db, "curiosity_search_mark", mark)
    return {
        "regions": len(regions),
        "added": len(added),
        "expired": expired + dropped,
        "active": min(len(active), policy.max_targets),
    }


def _open(t: dict) -> bool:
    return t.get("resolved_at") is None and t.get("expired_at") is None


def _closed_at(t: dict) -> float:
    return float(t.get("resolved_at") or t.get("expired_at") or 0.0)


def active_targets(agent: CrystalStore, now: float) -> list[dict]:
    """Open targets at ``now`` (one past its expiry counts as gone even before the next run)."""
    targets = get_meta(agent.db("primary"), "curiosity_targets", []) or []
    return [t for t in targets if _open(t) and now < t["expires_at"]]  # type: ignore[union-attr]


def curiosity_state(agent: CrystalStore, now: float | None = None) -> dict[str, Any]:
    """Regions (without centroids), active targets by priority, and counts per kind."""
    now = agent.clock() if now is None else now
    with agent.lock:
        regions = get_meta(agent.db("primary"), "curiosity_regions", []) or []
        targets = sorted(active_targets(agent, now), key=lambda t: (-t["priority"], t["created_at"], t["id"]))
    counts = dict.fromkeys(KINDS, 0)
    for t in targets:
        counts[t["kind"]] += 1
    return {
        "regions": [
            {k: r[k] for k in ("id", "size", "created_at", "last_activity", "example")}
            for r in regions  # type: ignore[union-attr]
        ],
        "targets": targets,
        "counts": counts,
    }


def mark_explored(agent: CrystalStore, target_ids: list[str], now: float) -> None:
    """Exploration dreamt about these targets: noted, not resolved."""
    with agent.lock:
        db = agent.db("primary")
        targets = get_meta(db, "curiosity_targets", []) or []
        for t in targets:  # type: ignore[union-attr]
            if t["id"] in target_ids:
                t["explored_at"] = now
        with db:
            set_meta(db, "curiosity_targets", targets)


def curiosity_resolve(agent: CrystalStore, target_id: str, now: float | None = None) -> dict[str, Any]:
    """Mark an open target resolved; it leaves ``curiosity_state`` and spikes the agent's
    curiosity_progress hormone event."""
    now = agent.clock() if now is None else now
    with agent.lock:
        db = agent.db("primary")
        targets = get_meta(db, "curiosity_targets", []) or []
        for t in targets:  # type: ignore[union-attr]
            if t["id"] == target_id and _open(t):
                t["resolved_at"] = now
                with db:
                    set_meta(db, "curiosity_targets", targets)
                agent.hormones.spike("curiosity_progress", now)  # a closed gap is a small reward
                return {"resolved": target_id, "at": now}
    known = ", ".join(t["id"] for t in active_targets(agent, now)) or "none"
    raise NimmerError(f"targetId: {target_id!r} is not an open curiosity target (open: {known})")
