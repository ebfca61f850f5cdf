"""Helpers for the memory tests.

HashEmbedder is a stand-in for the sentence model where a test exercises store mechanics over
hundreds of writes (hypothesis): deterministic 384-dim vectors from hashed character trigrams,
so similar texts still land near each other. Tests of retrieval quality use the real
all-MiniLM-L6-v2.
"""

from __future__ import annotations

import zlib

import numpy as np


class HashEmbedder:
    name = "hash-trigram-test-stand-in"
    dim = 384

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for row, text in enumerate(texts):
            padded = f"  {text.lower()}  "
            for i in range(len(padded) - 2):
                h = zlib.crc32(padded[i : i + 3].encode())
                out[row, h % self.dim] += 1.0 if (h >> 16) & 1 else -1.0
            norm = np.linalg.norm(out[row])
            out[row] /= norm if norm else 1.0
        return out


class Clock:
    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
