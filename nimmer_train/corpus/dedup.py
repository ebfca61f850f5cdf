"""Exact and near-duplicate detection for text chunks (MinHash with LSH banding).

Near duplicates are pairs whose estimated Jaccard similarity of word shingles reaches the
threshold (Broder 1997); LSH bands find candidate pairs without comparing all pairs.
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections import defaultdict

import numpy as np

_PRIME = np.uint64((1 << 61) - 1)
_WORD = re.compile(r"\w+")


def _normal(text: str) -> str:
    return " ".join(_WORD.findall(text.lower()))


def exact_key(text: str) -> str:
    """Key equal for chunks that differ only in case, punctuation or whitespace."""
    return hashlib.sha1(_normal(text).encode()).hexdigest()


def minhash(text: str, shingle_words: int, perms: np.ndarray) -> np.ndarray:
    """MinHash signature (one uint64 per permutation) of the word shingles of ``text``."""
    words = _WORD.findall(text.lower())
    n = max(1, len(words) - shingle_words + 1)
    shingles = np.fromiter(
        (zlib.crc32(" ".join(words[i : i + shingle_words]).encode()) for i in range(n)),
        dtype=np.uint64,
        count=n,
    )
    a, b = perms[:, :1], perms[:, 1:]
    hashed = (a * shingles[None, :] + b) % _PRIME
    return hashed.min(axis=1)


def find_duplicates(
    texts: list[str], threshold: float, shingle_words: int = 5, num_perm: int = 64, seed: int = 0
) -> tuple[set[int], set[int]]:
    """Return (exact, near): indices to drop. The first occurrence of each group is kept."""
    exact: set[int] = set()
    seen: dict[str, int] = {}
    for i, text in enumerate(texts):
        key = exact_key(text)
        if key in seen:
            exact.add(i)
        else:
            seen[key] = i
    rng = np.random.default_rng(seed)
    a = rng.integers(1, 1 << 31, num_perm, dtype=np.uint64)
    b = rng.integers(0, 1 << 31, num_perm, dtype=np.uint64)
    perms = np.stack([a, b], axis=1)
    keep = [i for i in range(len(texts)) if i not in exact]
    sigs = {i: minhash(texts[i], shingle_words, perms) for i in keep}
    rows = max(1, min(num_perm, _rows_per_band(threshold, num_perm)))
    buckets: dict[tuple[int, bytes], list[int]] = defaultdict(list)
    near: set[int] = set()
    for i in keep:
        sig = sigs[i]
        candidates = set()
        for band in range(num_perm // rows):
            key = (band, sig[band * rows : (band + 1) * rows].tobytes())
            candidates.update(buckets[key])
            buckets[key].append(i)
        if any(float(np.mean(sigs[j] == sig)) >= threshold for j in candidates if j not in near):
            near.add(i)
    return exact, near


def _rows_per_band(threshold: float, num_perm: int) -> int:
    """Rows per band so that the LSH S-curve's midpoint (1/b)^(1/r) sits just below threshold."""
    best, best_gap = 1, float("inf")
    for rows in range(1, num_perm + 1):
        bands = num_perm // rows
        mid = (1 / bands) ** (1 / rows)
        gap = abs(mid - (threshold - 0.1))
        if gap < best_gap:
            best, best_gap = rows, gap
    return best
