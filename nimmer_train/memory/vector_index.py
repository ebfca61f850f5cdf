"""An exact in-memory scan over a store's vectors, loaded from its vec0 table.

sqlite-vec's vec0 table is where the vectors live (durably, beside their entries). For queries
this keeps a float32 copy in RAM (384 floats = 1.5 kB per entry: 150 MB at 100k entries) and
scores all of it with one matrix-vector product: measured here, a vec0 float KNN over 100k x 384
takes about 70 ms and a binary-quantised one about 22 ms, while this scan takes a few ms
(benchmarks/bench_memory.py). Filters are boolean masks over class and category codes.
"""

from __future__ import annotations

import numpy as np

from nimmer_train.memory.entries import DATA_CATEGORIES, EMBEDDING_DIM, MEMORY_CLASSES


class VectorIndex:
    def __init__(self) -> None:
        self.ids = np.zeros(0, dtype=np.int64)
        self.matrix = np.zeros((0, EMBEDDING_DIM), dtype=np.float32)
        self.classes = np.zeros(0, dtype=np.int8)
        self.categories = np.zeros(0, dtype=np.int8)
        self._pending: list[tuple[int, np.ndarray, str, str]] = []

    @classmethod
    def load(cls, db) -> VectorIndex:  # noqa: ANN001 - an apsw connection
        index = cls()
        rows = db.execute("SELECT rowid, embedding, memory_class, data_category FROM entries_vec").fetchall()
        if rows:
            index.ids = np.array([r[0] for r in rows], dtype=np.int64)
            index.matrix = (
                np.frombuffer(b"".join(r[1] for r in rows), dtype=np.float32).reshape(len(rows), -1).copy()
            )
            index.classes = np.array([MEMORY_CLASSES.index(r[2]) for r in rows], dtype=np.int8)
            index.categories = np.array([DATA_CATEGORIES.index(r[3]) for r in rows], dtype=np.int8)
        return index

    def add(self, rowid: int, vector: np.ndarray, memory_class: str, category: str) -> None:
        self._pending.append((rowid, vector.astype(np.float32), memory_class, category))

    def _flush(self) -> None:
        if not self._pending:
            return
        ids, vectors, classes, categories = zip(*self._pending, strict=True)
        self.ids = np.concatenate([self.ids, np.array(ids, dtype=np.int64)])
        self.matrix = np.vstack([self.matrix, np.stack(vectors)])
        self.classes = np.concatenate([self.classes, [MEMORY_CLASSES.index(c) for c in classes]]).astype(
            np.int8
        )
        self.categories = np.concatenate(
            [self.categories, [DATA_CATEGORIES.index(c) for c in categories]]
        ).astype(np.int8)
        self._pending.clear()

    def remove(self, rowids: set[int]) -> None:
        self._flush()
        keep = ~np.isin(self.ids, np.fromiter(rowids, dtype=np.int64))
        self.ids, self.matrix = self.ids[keep], self.matrix[keep]
        self.classes, self.categories = self.classes[keep], self.categories[keep]

    def search(
        self, query: np.ndarray, n: int, classes: list[str] | None, categories: list[str] | None
    ) -> list[tuple[int, float]]:
        """The ``n`` nearest (rowid, cosine distance) among entries passing the filters."""
        self._flush()
        if not len(self.ids):
            return []
        similarity = self.matrix @ query.astype(np.float32)
        mask = np.ones(len(self.ids), dtype=bool)
        if classes is not None:
            mask &= np.isin(self.classes, [MEMORY_CLASSES.index(c) for c in classes])
        if categories is not None:
            mask &= np.isin(self.categories, [DATA_CATEGORIES.index(c) for c in categories])
        similarity = np.where(mask, similarity, -np.inf)
        n = min(n, int(mask.sum()))
        if n == 0:
            return []
        top = np.argpartition(-similarity, n - 1)[:n]
        top = top[np.argsort(-similarity[top], kind="stable")]
        return [(int(self.ids[i]), float(1.0 - similarity[i])) for i in top]
