"""Hybrid crystal search: a vector scan and FTS5 BM25 keyword search, fused by reciprocal rank
fusion (RRF), then weighted by recency and importance. Every search is logged.

    fused  = (w_vec / (k + rank_vec) + w_text / (k + rank_text)) / ((w_vec + w_text) / (k + 1))
    score  = fused * (1 + w_rec * recency + w_imp * importance) / (1 + w_rec + w_imp)
    recency = 0.5 ** (hours since the crystal's valid_from / recency_half_life_h)

A missing rank contributes 0, so ``score`` lies in (0, 1] and is 1 for a crystal first in both
lists with full recency and importance. ``min_score`` filters on ``similarity`` (the cosine of
query and crystal), not on the rank-based score, except that a keyword hit always passes (a
name or a number that MiniLM does not place well): a query nothing answers comes back empty,
and the log's top similarity is what part 2's curiosity engine reads as a knowledge gap.

The keyword list admits only hits whose BM25 reaches half the IDF of a term found in a single
document (``text_min_idf_share``): without that gate, matches on common words ("city", "name")
entered the fusion in numbers and pushed the evidence down (generated dialogues, 55 questions:
recall@5 0.80 hybrid vs 0.98 vector-only; with the gate 0.98 and 0.98). Weights are
Bitterbot's vector 0.7 / text 0.3.
Recency is of the knowledge (when it became valid), not of its last read, so reading an old fact
does not make it outrank the newer one that superseded it. Importance weighs little by default
(Bitterbot's lesson: old but critical facts must not get buried).

Expired and archived crystals, and superseded ones (``valid_to`` set), are left out unless
asked for. The vectors live in an in-memory matrix per store (as in vector_index.py) with a
state per row, kept in step with this process's writes and reloaded when another connection
has committed (PRAGMA data_version). The scan runs BLAS on one thread: a 100k x 384 product
took 24 ms with OpenBLAS's two threads on this loaded 2-core machine and 13 ms on one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import apsw
import numpy as np
from threadpoolctl import ThreadpoolController

from nimmer_train.memory.crystals import SEARCHABLE

LIVE, SUPERSEDED, GONE = 0, 1, 2
BLAS = ThreadpoolController()  # one matrix-vector product is fastest on one thread (and under load)
_STOPWORD_TEXT = """a an and are as at be by did do does for from had has have he her his how i in is it
its me my of on or our she so that the their them they this to was we were what when where which who
why will with you your"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())


@dataclass(frozen=True)
class SearchWeights:
    vector: float = 0.7
    text: float = 0.3
    rrf_k: int = 60
    recency: float = 0.15
    importance: float = 0.05
    recency_half_life_h: float = 48.0
    candidates: int = 4  # the vector list takes candidates * max_results
    text_candidates: int = 4  # the keyword list takes text_candidates * max_results
    text_min_idf_share: float = 0.5  # a keyword hit needs BM25 >= this share of a unique term's IDF


def state_of(lifecycle: str, valid_to: float | None) -> int:
    if lifecycle not in SEARCHABLE:
        return GONE
    return LIVE if valid_to is None else SUPERSEDED


class LiveIndex:
    """The vectors of one store with a search state per row."""

    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self.matrix = np.zeros((0, 384), dtype=np.float32)
        self.states = np.zeros(0, dtype=np.int8)
        self.pos: dict[int, int] = {}
        self._pending: list[tuple[int, np.ndarray, int]] = []
        self.data_version = -1

    def load(self, db: apsw.Connection) -> None:
        rows = db.execute(
            "SELECT v.rowid, v.embedding, c.lifecycle, c.valid_to FROM entries_vec v "
            "JOIN crystals c ON c.entry_id = v.rowid ORDER BY v.rowid"
        ).fetchall()
        self._pending.clear()
        self.ids = np.array([r[0] for r in rows], dtype=np.int64)
        self.matrix = (
            np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), -1).copy()
            if rows
            else np.zeros((0, 384), dtype=np.float32)
        )
        self.states = np.array([state_of(r[2], r[3]) for r in rows], dtype=np.int8)
        self.pos = {int(i): n for n, i in enumerate(self.ids)}
        self.data_version = db.execute("PRAGMA data_version").fetchone()[0]

    def refresh(self, db: apsw.Connection) -> None:
        """Reload when another connection committed since the last load."""
        if db.execute("PRAGMA data_version").fetchone()[0] != self.data_version:
            self.load(db)

    def add(self, entry_id: int, vector: np.ndarray, state: int = LIVE) -> None:
        self._pending.append((entry_id, vector.astype(np.float32), state))

    def _flush(self) -> None:
        if not self._pending:
            return
        ids, vectors, states = zip(*self._pending, strict=True)
        start = len(self.ids)
        self.ids = np.concatenate([self.ids, np.array(ids, dtype=np.int64)])
        self.matrix = np.vstack([self.matrix, np.stack(vectors)])
        self.states = np.concatenate([self.states, np.array(states, dtype=np.int8)])
        self.pos.update({int(i): start + n for n, i in enumerate(ids)})
        self._pending.clear()

    def set_state(self, entry_id: int, state: int) -> None:
        self._flush()
        if entry_id in self.pos:
            self.states[self.pos[entry_id]] = state

    def remove(self, entry_ids: set[int]) -> None:
        self._flush()
        keep = ~np.isin(self.ids, np.fromiter(entry_ids, dtype=np.int64))
        self.ids, self.matrix, self.states = self.ids[keep], self.matrix[keep], self.states[keep]
        self.pos = {int(i): n for n, i in enumerate(self.ids)}

    def vector(self, entry_id: int) -> np.ndarray | None:
        self._flush()
        n = self.pos.get(entry_id)
        return None if n is None else self.matrix[n]

    def mask(self, include_superseded: bool, include_expired: bool) -> np.ndarray:
        self._flush()
        mask = self.states == LIVE
        if include_superseded:
            mask |= self.states == SUPERSEDED
        if include_expired:
            mask |= self.states == GONE
        return mask

    def nearest(self, query: np.ndarray, n: int, mask: np.ndarray) -> list[tuple[int, float]]:
        """The ``n`` most similar (entry_id, cosine) among rows in ``mask``."""
        self._flush()
        if not len(self.ids) or n <= 0:
            return []
        with BLAS.limit(limits=1, user_api="blas"):
            scores = self.matrix @ query.astype(np.float32)
        similarity = np.where(mask, scores, -np.inf)
        n = min(n, int(mask.sum()))
        if n == 0:
            return []
        top = np.argpartition(-similarity, n - 1)[:n]
        top = top[np.argsort(-similarity[top], kind="stable")]
        return [(int(self.ids[i]), float(similarity[i])) for i in top]

    def similarity(self, query: np.ndarray, entry_ids: list[int]) -> dict[int, float]:
        self._flush()
        rows = [self.pos[i] for i in entry_ids if i in self.pos]
        values = self.matrix[rows] @ query.astype(np.float32) if rows else []
        return {int(self.ids[r]): float(v) for r, v in zip(rows, values, strict=True)}


def fts_query(query: str) -> str | None:
    """An FTS5 OR-query of the query's content words (quoted, so no FTS syntax gets through)."""
    words = dict.fromkeys(w for w in re.findall(r"\w+", query.lower()) if w not in STOPWORDS and len(w) > 1)
    return " OR ".join(f'"{w}"' for w in words) or None


def keyword_ranked(
    db: apsw.Connection, index: LiveIndex, query: str, n: int, mask: np.ndarray, min_idf_share: float = 0.0
) -> list[int]:
    """Entry ids by BM25 (best first) among rows in ``mask``, at most ``n``, each scoring at
    least ``min_idf_share`` of the IDF of a term found in one document only: matches on common
    words alone ("city", "name") are noise to fuse, a rare name or number is not."""
    expression = fts_query(query)
    if expression is None or n <= 0:
        return []
    index._flush()
    docs = max(1, len(index.ids))
    floor = min_idf_share * math.log((docs - 1 + 0.5) / 1.5 + 1)
    out: list[int] = []
    for rowid, score in db.execute(
        "SELECT rowid, bm25(entries_fts) FROM entries_fts WHERE entries_fts MATCH ? ORDER BY rank LIMIT ?",
        (expression, max(50, 4 * n)),
    ):
        if -score < floor:
            break  # best first: the rest score lower still
        at = index.pos.get(rowid)
        if at is not None and mask[at]:
            out.append(rowid)
            if len(out) == n:
                break
    return out


def fuse(vector_ranked: list[int], text_ranked: list[int], weights: SearchWeights) -> dict[int, float]:
    """Reciprocal rank fusion, normalised so first in both lists is 1."""
    fused: dict[int, float] = {}
    for ranked, weight in ((vector_ranked, weights.vector), (text_ranked, weights.text)):
        for rank, entry_id in enumerate(ranked, start=1):
            fused[entry_id] = fused.get(entry_id, 0.0) + weight / (weights.rrf_k + rank)
    norm = (weights.vector + weights.text) / (weights.rrf_k + 1)
    return {i: v / norm for i, v in fused.items()}


def weighted(fused: float, recency: float, importance: float, weights: SearchWeights) -> float:
    return (
        fused
        * (1 + weights.recency * recency + weights.importance * importance)
        / (1 + weights.recency + weights.importance)
    )


def recency(valid_from: float, now: float, half_life_h: float) -> float:
    return 0.5 ** (max(0.0, now - valid_from) / 3600 / half_life_h)
