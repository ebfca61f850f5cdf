"""The contributor's consent, as a newcomer types it: `nimmer memory generate` (opt-out by
default, a profile always, no silent append), `nimmer consent show|set|revoke|exclude`, and
`nimmer memory inspect` showing tier, contributor id and spend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nimmer_train.cli import main
from nimmer_train.memory.consent import (
    PROFILE_FILE,
    contributor_id,
    get_consent,
    takes_part,
    training_examples,
)
from nimmer_train.memory.contributions import record
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from tests.helpers.memory import HashEmbedder


def _out(capsys: pytest.CaptureFixture[str]) -> dict:
    return json.loads(capsys.readouterr().out)


def _player(folder: Path, **kwargs: object) -> Path:
    generate_player(folder, HashEmbedder(), seed=3, entries=60, player_id="player-7f3e", **kwargs)
    return folder


def test_generate_defaults_to_opt_out_writes_a_profile_and_never_appends_silently(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = tmp_path / "players" / "me"
    assert (
        main(["memory", "generate", str(me), "--seed", "3", "--entries", "20"]) == 0
    )  # the CLI's real embedder
    made = _out(capsys)
    assert made["consent"] == "opt_out" and (me / PROFILE_FILE).exists()
    assert json.loads((me / PROFILE_FILE).read_text())["player_id"] == "player-s3"
    assert main(["memory", "generate", str(me), "--seed", "4", "--entries", "20"]) == 1
    assert "already holds a player's stores; pass --append" in capsys.readouterr().err
    assert main(["consent", "set", "A1_federated", str(me)]) == 0
    capsys.readouterr()
    assert main(["memory", "generate", str(me), "--seed", "4", "--entries", "20", "--append"]) == 0
    assert _out(capsys)["consent"] == "A1_federated"  # --append keeps the player's consent
    assert main(["memory", "inspect", str(me)]) == 0
    assert _out(capsys)["primary.sqlite"]["entries"] > made["primary"]
    other = tmp_path / "players" / "other"
    generate_player(other, HashEmbedder(), seed=3, entries=20, tier="A2_anonymized")
    memory = PlayerMemory(other, HashEmbedder())
    assert get_consent(memory).sharing_tier == "A2_anonymized"
    memory.close()


def test_consent_set_needs_the_profile_and_revoke_stops_sharing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bare = tmp_path / "bare"
    PlayerMemory(bare, HashEmbedder()).close()  # stores, but no profile
    assert main(["consent", "set", "A1_federated", str(bare)]) == 1
    err = capsys.readouterr().err
    assert f"{bare / PROFILE_FILE} is missing" in err and "--player-id" in err
    assert main(["consent", "set", "A1_federated", str(bare), "--player-id", "p-1"]) == 1
    assert "go together" in capsys.readouterr().err
    assert (
        main(["consent", "set", "A1_federated", str(bare), "--player-id", "p-1", "--player-name", "Ana"]) == 0
    )
    shown = _out(capsys)
    assert shown["tier"] == "A1_federated" and shown["profile"] == "present"
    assert shown["federated_rounds"] == "takes part" and "clasp" not in shown["categories_shared"]

    me = _player(tmp_path / "me", tier="A1_federated")
    memory = PlayerMemory(me, HashEmbedder())
    shared = len(training_examples(memory, "A1_federated", "player-7f3e", "Marta"))
    memory.close()
    assert shared > 0
    assert main(["consent", "exclude", "casual_dialog", str(me)]) == 0
    assert "casual_dialog" in _out(capsys)["categories_excluded"]
    assert main(["consent", "revoke", str(me)]) == 0
    shown = _out(capsys)
    assert shown["revoked_at"] and shown["federated_rounds"].startswith("takes no part: consent was revoked")
    memory = PlayerMemory(me, HashEmbedder())
    try:
        assert training_examples(memory, "A1_federated", "player-7f3e", "Marta") == []
        assert takes_part(get_consent(memory)) is not None
    finally:
        memory.close()
    assert main(["consent", "set", "A1_federated", str(me)]) == 0  # a fresh grant lifts the revocation
    shown = _out(capsys)
    assert shown["revoked_at"] is None and "casual_dialog" in shown["categories_excluded"]
    assert main(["consent", "set", "opt_out", str(me)]) == 0
    assert _out(capsys)["federated_rounds"] == "takes no part: the consent tier is opt_out, not A1_federated"
    assert main(["consent", "show", str(tmp_path / "nobody")]) == 1
    assert "no player at" in capsys.readouterr().err


def test_inspect_shows_tier_contributor_id_and_spend(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = _player(tmp_path / "me", tier="A1_federated")
    assert main(["memory", "inspect", str(me)]) == 0
    fed = _out(capsys)["federation"]
    assert fed["tier"] == "A1_federated" and fed["contributor_id"] is None and fed["spend"] == {}
    memory = PlayerMemory(me, HashEmbedder())
    ident = contributor_id(memory)
    memory.close()
    told = ({"rounds_done": 0, "not_released": []}, {"rounds_done": 1, "not_released": []})
    for (r, eps), outcome in zip(((1, 0.5), (2, 0.8)), told, strict=True):
        record(
            me, "round", federation="fl.example:8000", federation_id="f-1", round=r, tier="A1_federated",
            left="masked update", examples_used=12, epsilon=eps, epsilon_local=3.0, delta=1e-5,
            outcome=outcome,
        )  # fmt: skip
    assert main(["memory", "inspect", str(me)]) == 0
    fed = _out(capsys)["federation"]
    assert fed["contributor_id"] == ident
    assert fed["spend"] == {  # round 1 released (round 2's instructions say so), round 2 pending
        "f-1": {
            "federation": "fl.example:8000", "rounds": 2, "released": 1, "not_released": 0, "pending": 1,
            "last_round": 2, "epsilon": 0.5, "epsilon_if_pending_released": 0.8, "epsilon_local": 3.0,
            "delta": 1e-5,
        }
    }  # fmt: skip
    assert fed["spend_total"]["epsilon_a1_user_level_sum"] == 0.5
    assert main(["contributions", str(me)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert (
        "round 1 of fl.example:8000" in lines[0]
        and "epsilon 0.5" in lines[0]
        and "round released" in lines[0]
    )
    assert (
        "round 2 of fl.example:8000" in lines[1]
        and "epsilon 0.8" in lines[1]
        and "if this round is" in lines[1]
    )
    assert lines[2].startswith("spend in fl.example:8000 (federation f-1)") and lines[3].startswith("total")
    assert "player-7f3e" not in (me / "contributions.jsonl").read_text()  # ids stay out of the log too
