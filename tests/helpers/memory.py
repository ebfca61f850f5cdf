"""Helpers for the memory tests.

HashEmbedder is a stand-in for the sentence model where a test exercises store mechanics over
hundreds of writes (hypothesis): deterministic 384-dim vectors from hashed character trigrams,
so similar texts still land near each other. Tests of retrieval quality use the real
all-MiniLM-L6-v2.
"""

from __future__ import annotations

import zlib

import numpy as np

# the memory tools every registry offers, part 1's four then part 2's (dreams, curiosity)
MEMORY_TOOLS = [
    "memory_search",
    "memory_get",
    "memory_status",
    "working_memory_note",
    "dream_search",
    "dream_status",
    "curiosity_state",
    "curiosity_resolve",
]


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


class CountingEmbedder(HashEmbedder):
    """HashEmbedder that counts the texts it embeds (re-embedding tests)."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def embed(self, texts: list[str]) -> np.ndarray:
        self.texts += list(texts)
        return super().embed(texts)


def agent_memory(folder, clock: Clock | None = None, embedder=None):  # noqa: ANN001, ANN201
    """An AgentMemory over ``folder`` with the hash embedder and a test clock."""
    from nimmer_train.agent.agent_memory import AgentMemory

    return AgentMemory(folder, embedder or HashEmbedder(), clock=clock or Clock())


def write_v3_store(folder, rows: list[tuple[str, str, str, str]]) -> None:  # noqa: ANN001
    """A primary store as schema v3 (before crystals) left it: entries and vectors, no crystals.
    ``rows`` are (event_uid, text, memory_class, data_category)."""
    from nimmer_train.memory.player_memory import PRIMARY_FILE
    from nimmer_train.memory.schema import PRIMARY_MIGRATIONS

    write_old_store(folder / PRIMARY_FILE, PRIMARY_MIGRATIONS[:3], rows)


def write_old_store(path, migrations, rows: list[tuple[str, str, str, str]]) -> None:  # noqa: ANN001
    """A store at ``path`` as an older schema (``migrations``) left it, plaintext, with ``rows``
    (event_uid, text, memory_class, data_category) and their hash-embedder vectors."""
    from nimmer_train.memory.db import connect, migrate
    from nimmer_train.memory.entries import COLUMNS, MemoryEntry

    db = connect(path)
    migrate(db, migrations, path)
    vectors = HashEmbedder().embed([r[1] for r in rows])
    with db:
        for (uid, text, cls, cat), vector in zip(rows, vectors, strict=True):
            entry = MemoryEntry(uid, text, "npc", cls, cat, created_at=1.0e9, updated_at=1.0e9)
            db.execute(
                f"INSERT INTO entries ({', '.join(COLUMNS)}) VALUES ({', '.join('?' * len(COLUMNS))})",
                entry.row(),
            )
            db.execute(
                "INSERT INTO entries_vec (rowid, embedding, memory_class, data_category) VALUES (?, ?, ?, ?)",
                (db.last_insert_rowid(), vector.tobytes(), cls, cat),
            )
    db.close()
