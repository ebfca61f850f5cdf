"""Replays of validly signed manifests against ``nimmer contributions`` (real Ed25519 signatures,
a real SQLite registry, the CLI): another version's signed manifest put in a version's folder (its
registry row rewritten to match) is refused, since the signed label is not the folder's; a signed
version of a federation this device never trained in is believed of nothing here (no ``published``
line, the spend unchanged)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from nimmer_train.artifacts import MANIFEST
from nimmer_train.cli import main
from nimmer_train.memory import contributions
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.publish.manifest import SIGNATURE
from nimmer_train.publish.registry import Registry
from tests.helpers.memory import HashEmbedder
from tests.unit.publish.test_released_rounds_refuses_malformed_claims import (  # noqa: F401
    ADDRESS,
    FED,
    keys,
    signed_version,
)


def _player(folder: Path) -> Path:
    generate_player(folder, HashEmbedder(), seed=3, entries=5, tier="A1_federated")
    for r, done in ((1, 0), (2, 1)):
        contributions.record(
            folder, "round", federation=ADDRESS, federation_id=FED, round=r, tier="A1_federated", left="u",
            examples_used=3, epsilon=1.0 * r, epsilon_local=2.0, delta=1e-5,
            outcome={"rounds_done": done, "not_released": []},
        )  # fmt: skip
    return folder


def _show(player: Path, releases: Path, trusted: Path) -> int:
    return main(["contributions", str(player), "--releases", str(releases), "--trusted-keys", str(trusted)])


def test_another_versions_signed_manifest_in_a_versions_folder_is_refused(
    tmp_path: Path,
    keys: tuple[Path, Path],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    key, trusted = keys
    releases, player = tmp_path / "releases", _player(tmp_path / "me")
    merged = {"federation_id": FED, "rounds_released": [1, 2], "rounds_done": 2, "epsilon_a1_user_level": 2.4}
    signed_version(releases, key, 2, {**merged, "rounds_released": [1]})  # v2 released round 1 only
    v3 = signed_version(releases, key, 3, merged)
    v2 = releases / "nimmerworld-base-v2"
    for name in (MANIFEST, SIGNATURE):
        shutil.copyfile(releases / v3 / name, v2 / name)  # v3's word replayed as v2's
    registry = Registry.open(releases)
    try:
        sha = registry.find("v3").row["manifest_sha256"]
        with registry.writing() as db:
            db.execute("UPDATE base_model_versions SET manifest_sha256 = ? WHERE version_number = 2", (sha,))
    finally:
        registry.close()
    assert _show(player, releases, trusted) == 1
    assert "is not nimmerworld-base-v2's manifest" in capsys.readouterr().err
    assert [e["label"] for e in contributions.entries(player) if e["kind"] == "published"] == [v3]


def test_a_signed_version_of_a_federation_this_device_never_joined_changes_nothing(
    tmp_path: Path,
    keys: tuple[Path, Path],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    key, trusted = keys
    releases, player = tmp_path / "releases", _player(tmp_path / "me")
    other = {
        "federation_id": "0" * 32,
        "rounds_released": [1, 2],
        "rounds_done": 2,
        "epsilon_a1_user_level": 0.1,
    }
    signed_version(releases, key, 2, other)
    before = contributions.spend(player)
    assert _show(player, releases, trusted) == 0
    assert "released in" not in capsys.readouterr().out
    assert [e["kind"] for e in contributions.entries(player)] == ["round", "round"]
    assert contributions.spend(player) == before
