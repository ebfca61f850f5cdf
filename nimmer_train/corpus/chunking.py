"""Paragraph-aligned chunks and the per-work contiguous train/validation split."""

from __future__ import annotations

import re

import numpy as np

_SENTENCE_END = re.compile(r"(?<=[.!?;:])\s+")


def _split_long(para: str, limit: int) -> list[str]:
    """Split a paragraph longer than ``limit`` at sentence ends, then at spaces if needed."""
    pieces, current = [], ""
    for sentence in _SENTENCE_END.split(para):
        while len(sentence) > limit:  # one huge sentence: cut at the last space before the limit
            cut = sentence.rfind(" ", 0, limit)
            cut = cut if cut > 0 else limit
            if current:
                pieces.append(current)
                current = ""
            pieces.append(sentence[:cut])
            sentence = sentence[cut:].lstrip()
        if current and len(current) + 1 + len(sentence) > limit:
            pieces.append(current)
            current = sentence
        else:
            current = f"{current} {sentence}" if current else sentence
    if current:
        pieces.append(current)
    return pieces


def chunk_paragraphs(paras: list[str], max_chars: int, min_chars: int) -> list[str]:
    """Greedily pack whole paragraphs into chunks of at most ``max_chars`` characters.

    A paragraph longer than ``max_chars`` is split at sentence ends. A chunk shorter than
    ``min_chars`` (a heading, a stray line) is merged into its neighbour when that fits.
    """
    units = [piece for para in paras for piece in _split_long(para, max_chars)]
    chunks: list[str] = []
    current = ""
    for unit in units:
        if current and len(current) + 2 + len(unit) > max_chars and len(current) >= min_chars:
            chunks.append(current)
            current = unit
        else:
            current = f"{current}\n\n{unit}" if current else unit
    if current:
        if chunks and len(current) < min_chars and len(chunks[-1]) + 2 + len(current) <= max_chars:
            chunks[-1] = f"{chunks[-1]}\n\n{current}"
        else:
            chunks.append(current)
    return chunks


def contiguous_validation(n: int, fraction: float, seed: int) -> range:
    """Indices of one contiguous validation section of ``n`` ordered chunks.

    Its length is ``ceil(n * fraction)`` (at least 1 when n >= 2) and its position is drawn
    from ``seed``, so every run with the same seed makes the same split.
    """
    if n < 2:
        return range(0)
    size = max(1, int(np.ceil(n * fraction)))
    start = int(np.random.default_rng(seed).integers(0, n - size + 1))
    return range(start, start + size)
