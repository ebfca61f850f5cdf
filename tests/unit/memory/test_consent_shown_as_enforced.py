"""Consent is shown exactly as the consent filter enforces it (issue 42): `consent show`,
`contribute` and `memory inspect` never list clasp as shared, never list a category both shared
and excluded, and list as shared exactly the categories the filter lets leave (checked against
``training_examples`` itself, over stored records that hold clasp and excluded categories among
the shared, as generated players and older records did). Generated players carry no consent date
in the future."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from nimmer_train.cli import main
from nimmer_train.memory.consent import (
    NEVER_SHARED,
    ConsentRecord,
    consent_view,
    get_consent,
    set_consent,
    training_examples,
)
from nimmer_train.memory.entries import DATA_CATEGORIES
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from tests.helpers.memory import HashEmbedder

PLAYER_ID = "player-5e1f"


def _player(folder: Path, seed: int, tier: str = "A1_federated") -> Path:
    generate_player(folder, HashEmbedder(), seed=seed, entries=80, player_id=PLAYER_ID, tier=tier)
    return folder


def _filtered_categories(folder: Path, tier: str) -> set[str]:
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        return {e["data_category"] for e in training_examples(memory, tier, PLAYER_ID, "Marta")}
    finally:
        memory.close()


def _stored_categories(folder: Path) -> set[str]:
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        return {e.data_category for e in memory.entries()}
    finally:
        memory.close()


@pytest.mark.parametrize("tier", ["A1_federated", "A2_anonymized"])
def test_shown_shared_categories_are_exactly_what_the_filter_lets_leave(tmp_path: Path, tier: str) -> None:
    """A stored record sharing everything, clasp included, with two exclusions (one of them
    also among the shared): the view lists what ``training_examples`` yields and nothing else."""
    folder = _player(tmp_path / "me", seed=11, tier=tier)
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        excluded = ("casual_dialog", "dream_content")
        set_consent(memory, ConsentRecord(tier, tuple(DATA_CATEGORIES), excluded, granted_at=1.0))
        view = consent_view(get_consent(memory))
    finally:
        memory.close()
    shared = set(view["categories_shared"])
    assert "clasp" not in shared and not shared & set(view["categories_excluded"])
    assert set(view["categories_excluded"]) == set(excluded) and view["never_shared"] == sorted(NEVER_SHARED)
    assert _filtered_categories(folder, tier) == shared & _stored_categories(folder)
    assert (
        _filtered_categories(folder, tier) and shared == set(DATA_CATEGORIES) - set(excluded) - NEVER_SHARED
    )


def test_generated_players_show_no_clasp_no_overlap_and_no_future_date(tmp_path: Path) -> None:
    """Across seeds (their drawn consent included clasp and exclusions among the shared before):
    the stored record is one `consent set` could make, and its date is not in the future, even
    though the generator's clock (start 2027 by default) runs ahead."""
    for seed in range(12):
        folder = _player(tmp_path / f"p{seed}", seed=seed)
        memory = PlayerMemory(folder, HashEmbedder())
        try:
            record = get_consent(memory)
        finally:
            memory.close()
        assert not set(record.data_categories_shared) & (NEVER_SHARED | set(record.excluded_categories))
        assert record.granted_at is not None and record.granted_at <= time.time()
        view = consent_view(record)
        assert _filtered_categories(folder, "A1_federated") == set(
            view["categories_shared"]
        ) & _stored_categories(folder)
    future = tmp_path / "future"
    generate_player(future, HashEmbedder(), seed=1, entries=10, start=time.time() + 86_400 * 365)
    memory = PlayerMemory(future, HashEmbedder())
    try:
        assert get_consent(memory).granted_at <= time.time()
    finally:
        memory.close()


def test_consent_show_and_contribute_print_the_enforced_view(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = _player(tmp_path / "me", seed=5)
    memory = PlayerMemory(folder, HashEmbedder())
    try:
        set_consent(
            memory,
            ConsentRecord("A1_federated", tuple(DATA_CATEGORIES), ("memorial_archive",), granted_at=1.0),
        )
        view = consent_view(get_consent(memory))
    finally:
        memory.close()
    assert main(["consent", "show", str(folder)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (
        shown["categories_shared"] == view["categories_shared"] and "clasp" not in shown["categories_shared"]
    )
    assert shown["categories_excluded"] == ["memorial_archive"]
    # contribute says what it shares before it looks for the operator's CA (missing here: exit 1)
    code = main(
        [
            "contribute",
            str(folder),
            "--superlink",
            "127.0.0.1:1",
            "--root-certificates",
            str(tmp_path / "no.crt"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    (line,) = [x for x in out.splitlines() if x.startswith("consent: A1_federated")]
    sharing = line.split("sharing ", 1)[1].split(";")[0]
    assert sharing.split(", ") == view["categories_shared"]
    assert "excluded memorial_archive" in line and "never clasp" in line
