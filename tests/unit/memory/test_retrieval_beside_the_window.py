"""Retrieval beside a conversation window (issue 40): the lines already in the prompt are left out
and not marked accessed; a retrieval that meets another process's write still answers."""

from __future__ import annotations

from pathlib import Path

import apsw

from nimmer_train.memory.player_memory import Mode
from nimmer_train.memory.sync import open_player
from tests.helpers.memory import HashEmbedder


def test_excluded_entries_are_neither_returned_nor_marked_accessed(tmp_path: Path) -> None:
    memory, _ = open_player(tmp_path / "p", HashEmbedder())
    shown = memory.write("My sister is called Ilse.", "player", "working", "casual_dialog", event_uid="w1")
    memory.write("Ilse keeps bees by the east gate.", "player", "working", "casual_dialog", event_uid="old")
    hits = memory.retrieve("Ilse", k=4, exclude={shown.event_uid})
    assert [h.entry.event_uid for h in hits] == ["old"]
    assert {e.event_uid: e.access_count for e in memory.entries()} == {"w1": 0, "old": 1}
    assert memory.has("w1") and not memory.has("w1", Mode.IN_BETWEEN) and not memory.has("nope")
    memory.close()


def test_a_retrieval_that_meets_another_writer_keeps_its_answer(tmp_path: Path) -> None:
    memory, _ = open_player(tmp_path / "p", HashEmbedder())
    memory.write("The well is poisoned.", "player", "working", "casual_dialog")
    memory.primary.setbusytimeout(50)
    other = apsw.Connection(str(tmp_path / "p" / "primary.sqlite"))
    other.execute("BEGIN IMMEDIATE")  # another process is writing
    try:
        hits = memory.retrieve("poisoned well", k=2)
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert [h.entry.text for h in hits] == ["The well is poisoned."]
    assert memory.entries()[0].access_count == 0  # its bookkeeping waited, the answer did not
    memory.close()
