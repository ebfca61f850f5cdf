"""The speak stage's NPCs remember (issue 40): `make demo`'s turns go through the player's
conversation store, so an NPC's second turn shows its first, and a second run of the stage shows
the first run's turns; ``runtime.conversation_tokens`` sets the window and is refused, with the key
named, when it cannot fit the ring's context beside the reply."""

from __future__ import annotations

from pathlib import Path

import pytest

from nimmer_train.config import ModelConfig
from nimmer_train.errors import ConfigError
from nimmer_train.runtime.conversation import Conversations, check_window
from nimmer_train.runtime.local_model import LocalModel
from nimmer_train.runtime.rings import RingA
from nimmer_train.runtime.stage import _speak
from tests.helpers.compose import config
from tests.helpers.published import REGISTERS, publish_registers


def test_a_window_budget_that_cannot_fit_the_context_is_refused_naming_the_key(model: LocalModel) -> None:
    ring = RingA(model)  # the tiny model's context: 512 positions
    check_window(256, 224, {"casual": ring})  # the defaults fit
    with pytest.raises(ConfigError, match=r"^runtime\.conversation_tokens: 400 conversation tokens .* 512"):
        check_window(400, 224, {"casual": ring})


def test_a_negative_window_budget_is_refused_by_the_schema() -> None:
    assert config().runtime.conversation_tokens == 256
    with pytest.raises(ConfigError, match=r"runtime\.conversation_tokens"):
        config("runtime.conversation_tokens=-1")


def test_a_relevance_floor_outside_cosines_range_is_refused_naming_the_key() -> None:
    assert config().runtime.memory_min_relevance == 0.35
    with pytest.raises(ConfigError, match=r"runtime\.memory_min_relevance: 1.5: a cosine similarity"):
        config("runtime.memory_min_relevance=1.5")


@pytest.mark.slow
def test_the_speak_stage_npcs_remember_earlier_turns(tmp_path: Path) -> None:
    # one register on a tiny model with room for a window (at 512 positions the bare prompt and
    # the knowledge stack's budgets leave none: the window is what the context leaves)
    tiny = ModelConfig(name="tiny", max_position_embeddings=2048)
    releases, trusted = publish_registers(tmp_path / "pub", REGISTERS[:1], tiny)
    cfg = config(
        f"paths.workdir={tmp_path}",
        f"runtime.releases_dir={releases}",
        f"runtime.trusted_keys={trusted}",
        "runtime.version=v1",
        "runtime.max_new_tokens=16",
        "runtime.conversation_tokens=200",
    )
    path = tmp_path / "turns.json"
    model = LocalModel.open(releases, "v1", trusted)
    try:
        first = _speak(cfg, model, path)
        again = _speak(cfg, model, path)  # a second run of the stage
    finally:
        model.close()
    npcs = {t.npc for t in first}
    by_npc = {n: [t for t in first if t.npc == n] for n in npcs}
    # each NPC speaks twice (casual on Ring A, deep on Ring B): the second turn shows the first
    assert all(turns[0].window_lines == 0 and turns[1].window_lines == 2 for turns in by_npc.values())
    assert all(t.window_lines >= 2 for t in again)  # the first run's turns are shown
    store = Conversations(Path(cfg.runtime.player_dir))
    try:
        assert all(store.count(n) == 8 for n in npcs)  # two runs, two turns, two lines each
        assert store.pending() == []  # every line also in the player's memory
    finally:
        store.close()
