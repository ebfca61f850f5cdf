"""Attacks on consent through `nimmer memory generate --append` (issue 23's review): appending
with a tier rewrote the device's profile to the command's default id and name (so the real
player's id and name were no longer redacted from what it shares), lifted a revocation and
replaced the player's exclusions. Real stores, no mocks."""

from __future__ import annotations

import json
from pathlib import Path

from nimmer_train.memory.consent import (
    exclude,
    get_consent,
    read_profile,
    revoke,
    takes_part,
    training_examples,
)
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from tests.helpers.memory import HashEmbedder


def test_appending_keeps_the_profile_the_exclusions_and_the_revocation(tmp_path: Path) -> None:
    me = tmp_path / "me"
    generate_player(
        me,
        HashEmbedder(),
        seed=1,
        entries=40,
        player_id="player-7f3e",
        player_name="Zoe",
        tier="A2_anonymized",
    )
    memory = PlayerMemory(me, HashEmbedder())
    try:
        exclude(memory, "memorial_archive")
        revoke(memory)
    finally:
        memory.close()
    for seed, tier in ((2, "A2_anonymized"), (3, None), (4, "A1_federated")):
        generate_player(
            me, HashEmbedder(), seed=seed, entries=40, player_id=f"player-s{seed}", tier=tier, append=True
        )
        assert read_profile(me) == ("player-7f3e", "Zoe")
        memory = PlayerMemory(me, HashEmbedder())
        try:
            record = get_consent(memory)
            assert "memorial_archive" in record.excluded_categories
            assert record.revoked_at is not None and "revoked" in str(takes_part(record, record.sharing_tier))
        finally:
            memory.close()


def test_entries_appended_are_the_profiles_player_and_are_redacted(tmp_path: Path) -> None:
    me = tmp_path / "me"
    generate_player(me, HashEmbedder(), seed=1, entries=30, player_id="player-7f3e", player_name="Zoe")
    generate_player(
        me, HashEmbedder(), seed=5, entries=120, player_id="player-s5", tier="A2_anonymized", append=True
    )  # the command's defaults: id player-s<seed>, name Marta
    memory = PlayerMemory(me, HashEmbedder())
    try:
        every = json.dumps([(e.text, e.speaker) for e in memory.entries()])
        shared = json.dumps(training_examples(memory, "A2_anonymized", *read_profile(me)))
    finally:
        memory.close()
    assert "Marta" not in every and "player-s5" not in every  # planted as the profile's player
    assert "[player]" in shared
    for identifier in ("Zoe", "7f3e", "Marta", "player-s5"):
        assert identifier not in shared


def test_the_profile_with_the_players_real_name_is_the_owners_only(tmp_path) -> None:
    from nimmer_train.memory.consent import write_profile

    write_profile(tmp_path, "player-7", "Zoë")
    assert (tmp_path / "profile.json").stat().st_mode & 0o777 == 0o600
    assert not list(tmp_path.glob(".profile.json.tmp-*"))
