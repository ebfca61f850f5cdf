"""The cell scan of a large store (memory/vector_cells.py) looks at a few per cent of the rows
and still holds the exact nearest ones; rows added after training are found at once, and rows
removed leave the cells aligned with the matrix."""

from __future__ import annotations

import numpy as np

from nimmer_train.memory.vector_cells import VectorCells


def _clustered(rng: np.random.Generator, n: int, clusters: int = 60) -> np.ndarray:
    """Unit vectors around ``clusters`` topics, as sentence embeddings of a conversation are."""
    centres = rng.standard_normal((clusters, 384)).astype(np.float32)
    rows = centres[rng.integers(0, clusters, n)] + 0.6 * rng.standard_normal((n, 384)).astype(np.float32)
    return rows / np.linalg.norm(rows, axis=1, keepdims=True)


def test_the_query_cells_hold_the_exact_nearest_rows_in_a_small_share_of_the_store() -> None:
    rng = np.random.default_rng(0)
    matrix = _clustered(rng, 6000)
    cells = VectorCells.train(matrix)
    found, scanned = [], []
    for q in matrix[rng.choice(len(matrix), 40, replace=False)] + 0.05 * rng.standard_normal((40, 384)):
        q = (q / np.linalg.norm(q)).astype(np.float32)
        rows = cells.rows(q)
        exact = set(np.argsort(-(matrix @ q))[:10].tolist())
        found.append(len(exact & set(rows.tolist())) / 10)
        scanned.append(len(rows) / len(matrix))
    assert np.mean(found) >= 0.95, f"exact top-10 in the scanned cells: {np.mean(found):.2f}"
    assert np.mean(scanned) <= 0.25, f"share of rows scanned: {np.mean(scanned):.2f}"


def test_a_row_added_after_training_is_scanned_at_once_and_removal_keeps_rows_aligned() -> None:
    rng = np.random.default_rng(1)
    matrix = _clustered(rng, 3000)
    cells = VectorCells.train(matrix)
    new = _clustered(rng, 1)
    cells.extend(new)
    assert len(matrix) in cells.rows(new[0]).tolist()  # the new row's position in the caller's matrix
    kept = np.ones(len(matrix) + 1, dtype=bool)
    kept[:100] = False
    cells.keep(kept)
    rows = cells.rows(new[0])
    assert len(cells.assignment) == int(kept.sum())
    assert rows.max() < int(kept.sum()) and len(matrix) - 100 in rows.tolist()
