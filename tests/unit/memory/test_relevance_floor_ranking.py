"""The knowledge stack's relevance floor picks among every candidate above it: a memory that
clears the floor is not crowded out by recent ones below it that the floor then drops."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from nimmer_train.memory.canon import assemble
from nimmer_train.memory.player_memory import Mode, PlayerMemory
from tests.helpers.memory import Clock, HashEmbedder

ROW = {"speaker": "npc", "memory_class": "working", "data_category": "casual_dialog"}


def test_a_relevant_old_memory_reaches_the_stack_past_recent_small_talk_below_the_floor(
    tmp_path: Path,
) -> None:
    clock = Clock()
    memory = PlayerMemory(tmp_path / "p", HashEmbedder(), clock=clock)
    axis = np.eye(384, dtype=np.float32)
    query = axis[0]
    fact = "Marta owes the scavenger three bolts."
    memory.write_many([{**ROW, "text": fact}], vectors=(0.8 * axis[0] + 0.6 * axis[1])[None])  # cosine 0.8
    clock.now += 1000 * 3600  # the fact is old; then eight lines of small talk, cosine 0.2 each
    talk = [{**ROW, "text": f"Nice weather at the gate, day {i}."} for i in range(8)]
    memory.write_many(talk, vectors=np.stack([0.2 * axis[0] + np.sqrt(0.96) * axis[2 + i] for i in range(8)]))
    scope = assemble(memory, "core", query, Mode.REALWORLD, {"primary": 200}, min_relevance=0.35)
    assert scope.items == (fact,)
