"""A signed published version may tell a device what the server never did (a device that left
early: its pending rounds become released or not released), but it never makes the device believe
it spent less than the server said. What the server said is a floor:

- a round the server told released stays released (its update was in the global model the server
  sent every device the next round: the privacy cost was paid, whatever a version later says);
- the server's final figure (the ``outcome`` epsilon) counts, even where a version covers it;
- a released round's own figure (the federation's epsilon after that round, computed on the
  device with the ledger's accountant from the mechanism the server announced) counts: the ledger
  only grows, so a version's epsilon below it understates.

The one correct lowering stays: a pending round a version leaves out is not released, and its
"if released" estimate leaves the spend. A version that does not say ``rounds_done`` covers the
rounds up to its last released one, not every round of the federation."""

from __future__ import annotations

from pathlib import Path

from nimmer_train.memory.contributions import entries, record, release_states, render, spend

ADDRESS = "fl.example:9092"


def _round(folder: Path, r: int, eps: float, done: int, not_released: list[int] | None = None) -> None:
    record(
        folder, "round", federation=ADDRESS, federation_id="f", round=r, tier="A1_federated", left="u",
        examples_used=3, epsilon=eps, epsilon_local=2.0, delta=1e-5,
        outcome={"rounds_done": done, "not_released": not_released or []},
    )  # fmt: skip


def _published(folder: Path, rounds: list[int], done: int | None, eps: float | None) -> None:
    record(
        folder, "published", federation_id="f", federation=ADDRESS, label="nimmerworld-base-v2",
        version_number=2, version_id="id-2", manifest_sha256="2" * 64, key_id="k",
        rounds_released=rounds, rounds_done=done, epsilon=eps, delta=1e-5,
    )  # fmt: skip


def _states(folder: Path, rounds: range) -> list[str]:
    states = release_states(entries(folder))
    return [states[("f", r)] for r in rounds]


def test_a_round_the_server_told_released_stays_released(tmp_path: Path) -> None:
    _round(tmp_path, 1, 1.0, 0)
    _round(tmp_path, 2, 1.4, 1)
    _round(tmp_path, 3, 1.9, 2)  # told: rounds 1 and 2 released; then the device left
    assert spend(tmp_path)["f"]["epsilon"] == 1.4
    _published(tmp_path, [1, 3], 3, 1.3)  # leaves round 2 out, with a lower figure
    assert _states(tmp_path, range(1, 4)) == ["released", "released", "released"]
    f = spend(tmp_path)["f"]
    assert f["epsilon"] == 1.9 and f["not_released"] == 0  # round 3's own figure, released
    line = render(entries(tmp_path))[2]  # the round's line says which figure counts
    assert "its epsilon 1.3" in line and "this round's own figure 1.9 is larger and counts" in line


def test_the_servers_final_epsilon_counts_where_a_version_covers_it(tmp_path: Path) -> None:
    for r in (1, 2, 3):
        _round(tmp_path, r, 0.5 * r, r - 1)
    record(
        tmp_path, "outcome", federation=ADDRESS, federation_id="f", rounds_done=3, not_released=[],
        final=True, epsilon=3.0, delta=1e-5,
    )  # fmt: skip
    _published(tmp_path, [1, 2, 3], 3, 0.5)
    assert spend(tmp_path)["f"]["epsilon"] == 3.0


def test_a_pending_round_a_version_leaves_out_leaves_the_spend(tmp_path: Path) -> None:
    """The correct lowering: round 3 was pending ("if released": 1.9); the version says it was not."""
    _round(tmp_path, 1, 1.0, 0)
    _round(tmp_path, 2, 1.4, 1)
    _round(tmp_path, 3, 1.9, 2)
    assert spend(tmp_path)["f"]["epsilon_if_pending_released"] == 1.9
    _published(tmp_path, [1, 2], 3, 1.4)
    assert _states(tmp_path, range(1, 4)) == ["released", "released", "not_released"]
    f = spend(tmp_path)["f"]
    assert (f["epsilon"], f.get("epsilon_if_pending_released")) == (1.4, None)


def test_a_version_without_rounds_done_covers_only_up_to_its_last_released_round(tmp_path: Path) -> None:
    for r in (1, 2, 3, 4):
        _round(tmp_path, r, 0.5 * r, 0)  # the device heard nothing of any round
    _published(tmp_path, [1, 2], None, 1.0)
    assert _states(tmp_path, range(1, 5)) == ["released", "released", "pending", "pending"]


def test_a_versions_smaller_delta_does_not_shrink_the_spends_delta(tmp_path: Path) -> None:
    """The spend's (epsilon, delta) pair holds for every source when each is the largest: a
    version's smaller delta beside the server's epsilon would claim a stronger guarantee."""
    _round(tmp_path, 1, 1.0, 0)
    record(
        tmp_path, "published", federation_id="f", federation=ADDRESS, label="nimmerworld-base-v2",
        version_number=2, version_id="id-2", manifest_sha256="2" * 64, key_id="k",
        rounds_released=[1], rounds_done=1, epsilon=0.5, delta=1e-12,
    )  # fmt: skip
    f = spend(tmp_path)["f"]
    assert (f["epsilon"], f["delta"]) == (1.0, 1e-5)
