"""A.2 uploads from the device's memory: each upload gets a fresh id unlinked to the player, the
pseudonymous contributor id is random, and revoking consent stops uploads."""

from __future__ import annotations

from pathlib import Path

from nimmer_train.memory.consent import ConsentRecord, a2_upload, contributor_id, sent_uploads, set_consent
from nimmer_train.memory.player_memory import PlayerMemory
from tests.helpers.memory import Clock, HashEmbedder

PLAYER_ID, PLAYER_NAME = "player-8f3a-unique", "Marta Okonkwo"


def test_uploads_get_fresh_unlinked_ids_and_the_contributor_id_is_random(tmp_path: Path) -> None:
    memory = PlayerMemory(tmp_path / PLAYER_ID, HashEmbedder(), clock=Clock())
    memory.write(
        f"{PLAYER_NAME} told the scavenger about the copper coil", PLAYER_NAME, "working", "casual_dialog"
    )
    set_consent(memory, ConsentRecord("A2_anonymized", ("casual_dialog",), ()))
    first = a2_upload(memory, PLAYER_ID, PLAYER_NAME)
    assert a2_upload(memory, PLAYER_ID, PLAYER_NAME) is None  # an entry goes into one upload only
    memory.write(f"{PLAYER_NAME} found a lamp", PLAYER_NAME, "working", "casual_dialog")
    second = a2_upload(memory, PLAYER_ID, PLAYER_NAME)
    assert first.upload_id != second.upload_id and sent_uploads(memory) == sorted(
        [first.upload_id, second.upload_id]
    )
    assert len(first.examples) == len(second.examples) == 1 and first.examples != second.examples
    assert "Marta" not in str(first.examples) + str(second.examples)
    cid = contributor_id(memory)
    assert (
        cid == contributor_id(memory)
        and PLAYER_ID not in cid
        and cid not in (first.upload_id, second.upload_id)
    )
    other = PlayerMemory(tmp_path / "other", HashEmbedder(), clock=Clock())
    assert contributor_id(other) != cid
    set_consent(memory, ConsentRecord("A2_anonymized", ("casual_dialog",), (), revoked_at=5.0))
    assert a2_upload(memory, PLAYER_ID, PLAYER_NAME) is None
