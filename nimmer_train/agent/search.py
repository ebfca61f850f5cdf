"""Hybrid crystal search: a vector scan and FTS5 BM25 keyword search, fused by weighted
reciprocal rank fusion (RRF), with recency and importance as tie-breakers. Every search is logged.

    fused   = (w_vec / (k + rank_vec) + w_text * s / (k + rank_text)) / ((w_vec + w_text) / (k + 1))
    score   = fused * (1 + (w_rec * recency + w_imp * importance - w_sup * superseded) / (k + 1))
              / (1 + (w_rec + w_imp) / (k + 1))
    recency = 0.5 ** (hours since the crystal's valid_from / recency_half_life_h)

A missing rank contributes 0, so ``score`` lies in (0, 1]. ``s`` is a keyword hit's strength: 0 at
the IDF gate below, 1 at the IDF of a term found in one document (a rare name or number counts in
full, a match on a word many crystals share counts little). The weights of recency, importance and
supersession are in rank places: adjacent places near the top of the list differ by a factor of
about 1 + 1/(k + 1), so ``w_rec = 1`` lifts a crystal of now by about one place over an old one
of the same relevance. They break ties, they do not outvote relevance: as plain factors (up to
+15 % recency, +5 % importance against 1.6 % per place at k = 60) they lifted the last session's
small talk over older evidence (generated dialogues: recall@1 0.38 hybrid, 0.45 vector-only,
against 0.82 for the cosine alone). ``k = 10`` rather than the usual 60: the lists hold only
4 x maxResults candidates, and at k = 60 every place is worth the same, so a crystal found by
both lists outranked the vector's clear first on a shared common word. The keyword side weighs
0.2 (Bitterbot's 0.3 lifted short, older statements that repeat the question's words over the
update that answers it). ``min_score`` filters on ``similarity`` (the cosine of query and
crystal), not on the rank-based score, except that a keyword hit always passes (a name or a number
that MiniLM does not place well): a query nothing answers comes back empty, and the log's top
similarity is what part 2's curiosity engine reads as a knowledge gap.

The keyword list admits only hits whose BM25 reaches half the IDF of a term found in a single
document (``text_min_idf_share``): without that gate, matches on common words ("city", "name")
entered the fusion in numbers and pushed the evidence down.
Recency is of the knowledge (when it became valid), not of its last read, so reading an old fact
does not make it outrank the newer one that superseded it. A superseded crystal (only searched
when asked for) loses ``w_sup`` places, so the fact that replaced it ranks first at equal relevance.
The agent's hormones (issue 17) scale ``w_imp`` by (1 + 0.2 D) and ``w_rec`` by (1 + 0.3 C), both
over their values at rest (:meth:`CrystalStore.search_weights`, crystal_store.py); they stay tie-breakers.

Expired and archived crystals, and superseded ones (``valid_to`` set), are left out unless
asked for. The vectors live in an in-memory matrix per store (as in vector_index.py) with a
state per row, kept in step with this process's writes and reloaded when another connection
has committed (PRAGMA data_version). The scan runs BLAS on one thread: a 100k x 384 product
took 24 ms with OpenBLAS's two threads on this loaded 2-core machine and 13 ms on one. From
``ANN_MIN_ROWS`` rows it scans only the query's nearest k-means cells (memory/vector_cells.py),
ranked by the exact cosine.
"""

from __future__ import annotations

import calendar
import math
import re
import time
from dataclasses import dataclass

import apsw
import numpy as np
from threadpoolctl import ThreadpoolController

from nimmer_train.agent.crystals import SEARCHABLE
from nimmer_train.memory.vector_cells import VectorCells

LIVE, SUPERSEDED, GONE = 0, 1, 2
BLAS = ThreadpoolController()  # one matrix-vector product is fastest on one thread (and under load)
_STOPWORD_TEXT = """a an and are as at be by did do does for from had has have he her his how i in is it
its me my of on or our she so that the their them they this to was we were what when where which who
why will with you your"""
STOPWORDS = frozenset(_STOPWORD_TEXT.split())
ANN_MIN_ROWS = 20_000  # from this many rows a vector search scans cells (vector_cells.py), not all


@dataclass(frozen=True)
class SearchWeights:
    """The fusion's weights (see the module docstring); recency, importance and superseded are
    in rank places."""

    vector: float = 0.8
    text: float = 0.2
    rrf_k: int = 10
    recency: float = 1.0
    importance: float = 0.5
    superseded: float = 2.0
    recency_half_life_h: float = 48.0
    candidates: int = 4  # the vector list takes candidates * max_results
    text_candidates: int = 4  # the keyword list takes text_candidates * max_results
    text_min_idf_share: float = 0.5  # a keyword hit needs BM25 >= this share of a unique term's IDF
    date: float = 0.8  # the list of crystals from a day the query names ("on 8 May 2023")
    bridge: float = 0.0  # the second hop: keyword hits on the names in the best hits (recall.py)
    bridge_seeds: int = 2
    other: float = 12.0  # a line about the player's relations, asked about the player (subjects.py)


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
        self.times = np.zeros(0, dtype=np.float64)  # valid_from: a date the query names selects by it
        self.pos: dict[int, int] = {}
        self._pending: list[tuple[int, np.ndarray, int, float]] = []
        self.data_version = -1
        self.ann_min_rows = ANN_MIN_ROWS
        self.cells: VectorCells | None = None  # trained on first search once the store is large

    def load(self, db: apsw.Connection) -> None:
        rows = db.execute(
            "SELECT v.rowid, v.embedding, c.lifecycle, c.valid_to, c.valid_from FROM entries_vec v "
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
        self.times = np.array([r[4] for r in rows], dtype=np.float64)
        self.pos = {int(i): n for n, i in enumerate(self.ids)}
        self.cells = None
        self.data_version = db.execute("PRAGMA data_version").fetchone()[0]

    def refresh(self, db: apsw.Connection) -> None:
        """Reload when another connection committed since the last load."""
        if db.execute("PRAGMA data_version").fetchone()[0] != self.data_version:
            self.load(db)

    def add(self, entry_id: int, vector: np.ndarray, state: int = LIVE, at: float = math.nan) -> None:
        self._pending.append((entry_id, vector.astype(np.float32), state, at))

    def _flush(self) -> None:
        if not self._pending:
            return
        ids, vectors, states, times = zip(*self._pending, strict=True)
        start = len(self.ids)
        self.ids = np.concatenate([self.ids, np.array(ids, dtype=np.int64)])
        self.matrix = np.vstack([self.matrix, np.stack(vectors)])
        self.states = np.concatenate([self.states, np.array(states, dtype=np.int8)])
        self.times = np.concatenate([self.times, np.array(times, dtype=np.float64)])
        self.pos.update({int(i): start + n for n, i in enumerate(ids)})
        if self.cells is not None:
            self.cells.extend(self.matrix[start:])
        self._pending.clear()

    def set_state(self, entry_id: int, state: int) -> None:
        self._flush()
        if entry_id in self.pos:
            self.states[self.pos[entry_id]] = state

    def remove(self, entry_ids: set[int]) -> None:
        self._flush()
        keep = ~np.isin(self.ids, np.fromiter(entry_ids, dtype=np.int64))
        self.ids, self.matrix, self.states = self.ids[keep], self.matrix[keep], self.states[keep]
        self.times = self.times[keep]
        self.pos = {int(i): n for n, i in enumerate(self.ids)}
        if self.cells is not None:
            self.cells.keep(keep)

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
        """The ``n`` most similar (entry_id, cosine) among rows in ``mask``: an exact scan, or
        from ``ann_min_rows`` rows on, a scan of the query's nearest cells (vector_cells.py),
        falling back to the exact scan when those hold fewer than ``n`` rows in ``mask``."""
        self._flush()
        if not len(self.ids) or n <= 0:
            return []
        query = query.astype(np.float32)
        with BLAS.limit(limits=1, user_api="blas"):
            rows = self._cell_rows(query)
            if rows is not None:
                rows = rows[mask[rows]]
                if len(rows) >= n:
                    return self._best(rows, self.matrix[rows] @ query, n)
            scores = self.matrix @ query
        similarity = np.where(mask, scores, -np.inf)
        n = min(n, int(mask.sum()))
        if n == 0:
            return []
        top = np.argpartition(-similarity, n - 1)[:n]
        top = top[np.argsort(-similarity[top], kind="stable")]
        return [(int(self.ids[i]), float(similarity[i])) for i in top]

    def _cell_rows(self, query: np.ndarray) -> np.ndarray | None:
        """The rows of the query's cells, or None below ``ann_min_rows`` (cells are trained on
        first need and again once the rows have doubled: a few seconds at 100k, once)."""
        if len(self.ids) < self.ann_min_rows:
            return None
        if self.cells is None or len(self.ids) > 2 * self.cells.trained_rows:
            self.cells = VectorCells.train(self.matrix)
        return self.cells.rows(query)

    def _best(self, rows: np.ndarray, scores: np.ndarray, n: int) -> list[tuple[int, float]]:
        top = np.argpartition(-scores, n - 1)[:n] if len(rows) > n else np.arange(len(rows))
        top = top[np.argsort(-scores[top], kind="stable")]
        return [(int(self.ids[rows[i]]), float(scores[i])) for i in top]

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
) -> list[tuple[int, float]]:
    """(entry id, strength) by BM25 (best first) among rows in ``mask``, at most ``n``, each
    scoring at least ``min_idf_share`` of the IDF of a term found in one document only: matches
    on common words alone ("city", "name") are noise to fuse, a rare name or number is not. The
    strength rises from 0 at that floor to 1 at the full IDF of a one-document term."""
    expression = fts_query(query)
    if expression is None or n <= 0:
        return []
    index._flush()
    docs = max(1, len(index.ids))
    unique = math.log((docs - 1 + 0.5) / 1.5 + 1)
    floor = min_idf_share * unique
    out: list[tuple[int, float]] = []
    for rowid, score in db.execute(
        "SELECT rowid, bm25(entries_fts) FROM entries_fts WHERE entries_fts MATCH ? ORDER BY rank LIMIT ?",
        (expression, max(50, 4 * n)),
    ):
        if -score < floor:
            break  # best first: the rest score lower still
        at = index.pos.get(rowid)
        if at is not None and mask[at]:
            strength = 1.0 if unique <= floor else min(1.0, (-score - floor) / (unique - floor))
            out.append((rowid, strength))
            if len(out) == n:
                break
    return out


def fuse(
    vector_ranked: list[tuple[int, float]],
    text_ranked: list[tuple[int, float]],
    weights: SearchWeights,
    dated: list[tuple[int, float]] = (),  # type: ignore[assignment]
) -> dict[int, float]:
    """Weighted reciprocal rank fusion of (entry id, cosine) and (entry id, keyword strength)
    lists, and of the crystals of a day the query names (by cosine) when it names one, best
    first, normalised so first in every list (at full strength) is 1. Equal cosines share a rank
    (the same text said twice), so recency alone orders them."""
    k = weights.rrf_k
    fused: dict[int, float] = {}
    rank, last = 0, None
    for n, (entry_id, similarity) in enumerate(vector_ranked, start=1):
        if last is None or abs(similarity - last) > 1e-6:
            rank, last = n, similarity
        fused[entry_id] = weights.vector / (k + rank)
    for n, (entry_id, strength) in enumerate(text_ranked, start=1):
        fused[entry_id] = fused.get(entry_id, 0.0) + weights.text * strength / (k + n)
    for n, (entry_id, _similarity) in enumerate(dated, start=1):
        fused[entry_id] = fused.get(entry_id, 0.0) + weights.date / (k + n)
    norm = (weights.vector + weights.text + (weights.date if dated else 0.0)) / (k + 1)
    return {i: v / norm for i, v in fused.items()}


def weighted(
    fused: float,
    recency: float,
    importance: float,
    weights: SearchWeights,
    superseded: bool = False,
    another: bool = False,
) -> float:
    """``fused`` with recency, importance (and supersession) as tie-breakers worth rank places,
    less ``weights.other`` places for someone else's fact (``another``, subjects.py; 12 at
    k = 10 brings its score to about 0: it ranks below every line that is not someone else's)."""
    place = 1.0 / (weights.rrf_k + 1)
    lift = weights.recency * recency + weights.importance * importance
    lift -= weights.superseded * superseded + weights.other * another
    return fused * max(0.0, 1 + place * lift) / (1 + place * (weights.recency + weights.importance))


def recency(valid_from: float, now: float, half_life_h: float) -> float:
    return 0.5 ** (max(0.0, now - valid_from) / 3600 / half_life_h)


_MONTH = "|".join(calendar.month_name[1:])
_DAY_MONTH = re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTH})\b,?\s*(\d{{4}})?", re.I)
_MONTH_DAY = re.compile(rf"\b({_MONTH})\s+(\d{{1,2}})(?:st|nd|rd|th)?\b,?\s*(\d{{4}})?", re.I)


def named_days(query: str, now: float) -> list[tuple[float, float]]:
    """The UTC days ``query`` names ("on 8 May 2023", "May 8th", "the 8th of May") as [start,
    end) seconds; without a year, the latest such day not after ``now``."""
    found = [(m[1], m[2], m[3]) for m in _DAY_MONTH.finditer(query)]
    found += [(m[2], m[1], m[3]) for m in _MONTH_DAY.finditer(query)]
    today = time.gmtime(now)
    days = []
    for day, month, year in found:
        number = [m.lower() for m in calendar.month_name].index(month.lower())
        years = [int(year)] if year else [today.tm_year, today.tm_year - 1]
        for y in years:
            if not 1 <= int(day) <= calendar.monthrange(y, number)[1]:
                continue
            start = calendar.timegm((y, number, int(day), 0, 0, 0))
            if year or start <= now:
                days.append((float(start), float(start + 86400)))
                break
    return days


def without_days(query: str) -> str:
    """``query`` less the days it names ("What did I do on 8 May 2027?" -> "What did I do on?"):
    the day selects the rows, the rest of the words rank them (the date's own words pulled the
    vector toward any line of small talk)."""
    rest = re.sub(r"\s+", " ", _MONTH_DAY.sub(" ", _DAY_MONTH.sub(" ", query))).strip()
    return re.sub(r"\s+(?=[?.!,;])", "", rest)


def dated_ranked(
    index: LiveIndex, query_vector: np.ndarray, days: list[tuple[float, float]], n: int, mask: np.ndarray
) -> list[tuple[int, float]]:
    """(entry id, cosine) of the crystals in ``mask`` valid from within ``days``, best first."""
    index._flush()
    if not days or not len(index.ids):
        return []
    inside = np.zeros(len(index.ids), dtype=bool)
    for start, end in days:
        inside |= (index.times >= start) & (index.times < end)
    rows = np.flatnonzero(mask & inside)  # score only that day's rows, not the whole matrix
    if not len(rows) or n <= 0:
        return []
    similarity = index.matrix[rows] @ query_vector.astype(np.float32)
    best = np.argsort(-similarity, kind="stable")[:n]
    return [(int(index.ids[rows[i]]), float(similarity[i])) for i in best]
