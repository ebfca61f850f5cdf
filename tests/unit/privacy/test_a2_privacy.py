"""A.2 on the device and at intake: anonymisation, the k threshold and forward-only deletion.
Uploads from the device's memory (fresh ids, the contributor id) are in tests/unit/memory/."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nimmer_train.errors import NimmerError
from nimmer_train.privacy.a2_pool import A2Pool, PoolTooSmall
from nimmer_train.privacy.anonymize import anonymize, scrub

PLAYER_ID, PLAYER_NAME = "player-8f3a-unique", "Marta Okonkwo"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("mail me at marta.o+game@example.co.uk tonight", "mail me at [email] tonight"),
        ("call +44 20 7946 0958 or (030) 1234-5678", "call [phone] or [phone]"),
        ("see https://forum.example.org/t/123?x=1 and www.nimmer.io", "see [url] and [url]"),
        ("my box is 192.168.0.17 or fe80::1ff:fe23:4567:890a", "my box is [ip] or [ip]"),
        ("I live at 221 Baker Street, London", "I live at [address], London"),
        (
            "Marta Okonkwo (player-8f3a-unique) met Jonas at the gate",
            "[player] ([player]) met [name] at the gate",
        ),
        ("marta okonkwo laughed", "[player] laughed"),
    ],
)
def test_scrub_replaces_identifiers(text: str, expected: str) -> None:
    assert scrub(text, PLAYER_ID, PLAYER_NAME, ("Jonas",)) == expected


def test_world_text_is_left_alone() -> None:
    text = "The ration line moved to the east gate in year 1203; three bolts for a copper coil."
    assert scrub(text, PLAYER_ID, PLAYER_NAME) == text


@settings(max_examples=60, deadline=None)
@given(st.lists(st.text(max_size=40), max_size=4), st.sampled_from(["", " ", "-", "\n"]))
def test_planted_identity_never_survives(filler: list[str], sep: str) -> None:
    text = sep.join([*filler, PLAYER_NAME, *filler, PLAYER_ID, "marta.o@example.com"])
    out = anonymize([{"text": text, "speaker": PLAYER_NAME}], PLAYER_ID, PLAYER_NAME).examples[0]
    joined = (out["text"] + out["speaker"]).lower()
    assert (
        PLAYER_ID.lower() not in joined and PLAYER_NAME.lower() not in joined and "example.com" not in joined
    )


def test_pool_needs_k_uploads_and_deletion_is_forward_only(tmp_path: Path) -> None:
    pool = A2Pool(tmp_path / "a2.sqlite", k=3)
    uploads = [anonymize([{"text": f"line {i}"}], f"p{i}", f"name{i}") for i in range(3)]
    for upload in uploads[:2]:
        pool.add(upload)
    with pytest.raises(PoolTooSmall, match="holds fewer than k=3 uploads"):
        pool.training_examples()
    pool.add(uploads[2])
    assert sorted(e["text"] for e in pool.training_examples()) == ["line 0", "line 1", "line 2"]
    pool.delete(uploads[0].upload_id)
    with pytest.raises(PoolTooSmall):
        pool.training_examples()
    with pytest.raises(NimmerError, match="was deleted"):
        pool.add(uploads[0])
    pool.add(anonymize([{"text": "line 3"}], "p3", "n3"))
    assert sorted(e["text"] for e in A2Pool(tmp_path / "a2.sqlite", k=3).training_examples()) == [
        "line 1",
        "line 2",
        "line 3",
    ]
