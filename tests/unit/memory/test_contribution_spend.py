"""The contributor's spend ledger (issue 42): kept per federation by the id the server keeps with
its privacy ledger (two federations behind one SuperLink address no longer overwrite each other),
a running total across federations, each round released, not released or pending as the server
told, revocation in the log, and a log written before federation ids read without losing a
round (one federation per run of increasing round numbers at an address)."""

from __future__ import annotations

from pathlib import Path

import pytest

from nimmer_train.memory.contributions import entries, record, release_states, render, render_spend, spend

ADDRESS = "fl.example:8000"


def _round(folder: Path, r: int, eps: float, ident: str | None = None, **told: object) -> None:
    extra = {"federation_id": ident} if ident else {}
    if told:
        extra["outcome"] = told
    record(
        folder, "round", federation=ADDRESS, round=r, tier="A1_federated", left="masked update",
        examples_used=10, epsilon=eps, epsilon_local=1.0 + r, delta=1e-5, **extra,
    )  # fmt: skip


def test_two_federations_on_one_address_keep_their_own_spend_and_a_total(tmp_path: Path) -> None:
    """The issue's case: a second federation on the same SuperLink replaced epsilon 7.08 with
    4.73 ("rounds: 3"); now each keeps its own, and the total adds them."""
    for r, eps in ((1, 4.1), (2, 7.08)):
        _round(tmp_path, r, eps, "fed-a", rounds_done=r - 1, not_released=[])
    record(tmp_path, "outcome", federation=ADDRESS, federation_id="fed-a", rounds_done=2, not_released=[],
           final=True, epsilon=7.08, delta=1e-5)  # fmt: skip
    _round(tmp_path, 1, 4.73, "fed-b", rounds_done=0, not_released=[])
    record(tmp_path, "outcome", federation=ADDRESS, federation_id="fed-b", rounds_done=1, not_released=[],
           final=True, epsilon=4.73, delta=1e-5)  # fmt: skip
    by = spend(tmp_path)
    assert set(by) == {"fed-a", "fed-b"}
    assert (by["fed-a"]["rounds"], by["fed-a"]["epsilon"]) == (2, 7.08)
    assert (by["fed-b"]["rounds"], by["fed-b"]["epsilon"]) == (1, 4.73)
    lines = render_spend(by)
    assert lines[-1].startswith("total over 2 federation(s): epsilon 11.81 (A.1 user-level")
    assert all("if this round is released" not in line for line in render(entries(tmp_path)))


def test_each_round_is_released_not_released_or_pending_as_the_server_told(tmp_path: Path) -> None:
    _round(tmp_path, 1, 1.0, "f", rounds_done=0, not_released=[])
    _round(tmp_path, 2, 1.5, "f", rounds_done=1, not_released=[])  # says round 1 was released
    _round(tmp_path, 3, 1.5, "f", rounds_done=2, not_released=[2])  # round 2 was not
    log = entries(tmp_path)
    assert [release_states(log)[("f", r)] for r in (1, 2, 3)] == ["released", "not_released", "pending"]
    lines = render(log)
    assert "round released" in lines[0] and "round not released: the federation spent nothing" in lines[1]
    assert "if this round is released" in lines[2]
    assert (
        spend(tmp_path)["f"]["epsilon"] == 1.0 and spend(tmp_path)["f"]["epsilon_if_pending_released"] == 1.5
    )
    # the federation ends: round 3 released, the server's final figure becomes the spend
    record(tmp_path, "outcome", federation=ADDRESS, federation_id="f", rounds_done=3, not_released=[2],
           final=True, epsilon=1.5, delta=1e-5)  # fmt: skip
    log = entries(tmp_path)
    assert release_states(log)[("f", 3)] == "released"
    assert not any("if this round is released" in line for line in render(log))
    f = spend(tmp_path)["f"]
    assert (f["released"], f["not_released"], f["pending"], f["epsilon"]) == (2, 1, 0, 1.5)
    assert "ended after round 3: rounds not released: 2" in render(log)[-1]


def test_revocation_and_grants_appear_in_the_log(tmp_path: Path) -> None:
    record(tmp_path, "consent_granted", tier="A1_federated", shared=["casual_dialog"])
    _round(tmp_path, 1, 1.0, "f", rounds_done=0, not_released=[])
    record(tmp_path, "consent_revoked")
    lines = render(entries(tmp_path))
    assert "consent A1_federated granted: sharing casual_dialog" in lines[0]
    assert "consent revoked: no round and no upload leaves this device from now on" in lines[2]


def test_an_address_keyed_log_is_read_per_federation_without_losing_a_round(tmp_path: Path) -> None:
    """A log from before federation ids: rounds 1-3 of one federation, then rounds 1-2 of a
    second at the same address, and another address between them."""
    for r, eps in ((1, 1.0), (2, 2.0), (3, 3.0)):
        _round(tmp_path, r, eps)
    record(tmp_path, "round", federation="other:8000", round=1, tier="A1_federated", left="masked update",
           examples_used=3, epsilon=0.7, epsilon_local=0.5, delta=1e-5)  # fmt: skip
    for r, eps in ((1, 0.5), (2, 0.9)):
        _round(tmp_path, r, eps)
    by = spend(tmp_path)
    assert {k: (v["rounds"], v["epsilon"]) for k, v in by.items()} == {
        f"legacy:{ADDRESS}#1": (3, 3.0),
        "legacy:other:8000#1": (1, 0.7),
        f"legacy:{ADDRESS}#2": (2, 0.9),
    }
    assert all(v["not_recorded"] == v["rounds"] for v in by.values())
    lines = render(entries(tmp_path))
    assert len(lines) == 6 and all("logged before release states" in line for line in lines)
    assert render_spend(by)[-1].startswith("total over 3 federation(s): epsilon 4.6 ")
    # a device that then joins a federation with an id keeps the old history beside it
    _round(tmp_path, 1, 0.3, "new", rounds_done=0, not_released=[])
    assert len(spend(tmp_path)) == 4 and spend(tmp_path)[f"legacy:{ADDRESS}#1"]["epsilon"] == 3.0


@pytest.mark.parametrize("kind", ["round", "outcome"])
def test_the_log_refuses_an_unknown_kind_but_knows_the_new_ones(tmp_path: Path, kind: str) -> None:
    with pytest.raises(ValueError, match="unknown contributions entry kind"):
        record(tmp_path, "spend")
    assert record(tmp_path, kind, federation=ADDRESS, round=1)["kind"] == kind


def _published(
    folder: Path, ident: str, label: str, number: int, rounds: list[int], done: int | None, eps: float
) -> None:
    record(
        folder, "published", federation_id=ident, federation=ADDRESS, label=label, version_number=number,
        version_id=f"id-{number}", manifest_sha256=f"{number:064x}", key_id="k", rounds_released=rounds,
        rounds_done=done, epsilon=eps, delta=1e-5,
    )  # fmt: skip


def test_a_signed_version_outranks_the_servers_word_and_covers_only_its_rounds(tmp_path: Path) -> None:
    """Rounds 2 and 3 pending (the device left early); v2 released round 3 of rounds 1-3: round 2
    becomes not released, 3 released in v2 with v2's epsilon; round 4 (a resumed federation,
    after the version's rounds_done) stays as the server told."""
    _round(tmp_path, 1, 1.0, "f", rounds_done=0, not_released=[])
    _round(tmp_path, 2, 1.4, "f", rounds_done=1, not_released=[])
    _round(tmp_path, 3, 1.9, "f", rounds_done=1, not_released=[])
    _round(tmp_path, 4, 2.5, "f", rounds_done=1, not_released=[])
    _published(tmp_path, "f", "nimmerworld-base-v2", 2, [1, 3], 3, 1.3)
    log = entries(tmp_path)
    assert [release_states(log)[("f", r)] for r in (1, 2, 3, 4)] == [
        "released", "not_released", "released", "pending",
    ]  # fmt: skip
    lines = render(log)
    assert "round released in nimmerworld-base-v2 (signed; its epsilon 1.3" in lines[2]
    assert "if this round is released" in lines[3]
    f = spend(tmp_path)["f"]
    # round 3 is released, so its own figure (1.9, the ledger's accountant after it) is a floor:
    # a version's lower figure (1.3) never shrinks the spend (test_signed_version_never_lowers_...)
    assert (f["epsilon"], f["released_in"], f["epsilon_if_pending_released"]) == (
        1.9,
        "nimmerworld-base-v2",
        2.5,
    )


def test_the_first_version_to_release_a_round_names_it_and_other_federations_are_untouched(
    tmp_path: Path,
) -> None:
    _round(tmp_path, 1, 1.0, "f", rounds_done=0, not_released=[])
    _round(tmp_path, 1, 3.0, "g", rounds_done=0, not_released=[])
    _published(tmp_path, "f", "nimmerworld-base-v3", 3, [1], None, 1.0)
    _published(tmp_path, "f", "nimmerworld-base-v2", 2, [1], None, 1.0)
    log = entries(tmp_path)
    assert "released in nimmerworld-base-v2" in render(log)[0]
    assert release_states(log)[("g", 1)] == "pending"
    assert spend(tmp_path)["g"]["epsilon"] is None


def test_record_published_keeps_only_this_devices_federations_once(tmp_path: Path) -> None:
    from nimmer_train.memory.contributions import record_published
    from nimmer_train.publish.released_rounds import FederationRelease

    _round(tmp_path, 1, 1.0, "f", rounds_done=0, not_released=[])
    mine = FederationRelease("f", "nimmerworld-base-v2", 2, "id-2", "a" * 64, "k", (1,), 1, 1.0, 1e-5)
    other = FederationRelease("x", "nimmerworld-base-v3", 3, "id-3", "b" * 64, "k", (1,), 1, 9.0, 1e-5)
    assert [e["label"] for e in record_published(tmp_path, [mine, other])] == ["nimmerworld-base-v2"]
    assert record_published(tmp_path, [mine, other]) == []
    assert [e["kind"] for e in entries(tmp_path)] == ["round", "published"]
