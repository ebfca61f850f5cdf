"""A signed version's word on a federation (``merged_adapter``) is believed only when it is
well-formed: round numbers that are plain, bounded positive integers, a ``rounds_done`` not below
the last round it releases, an epsilon that is a non-negative number (NaN and negative figures
would make a device show a smaller spend than it has: ``max(0.0, nan)`` is 0.0), a delta in
[0, 1], and a registry row whose number is the label's. Anything else refuses that version by
name (``nimmer contributions`` says so on stderr and records nothing of it) instead of crashing
every later ``nimmer contributions`` (a huge ``rounds_done`` once made ``float()`` overflow) or
shrinking the spend.

Real parts: an Ed25519 publisher key, the signed manifest bytes as publish writes them
(``manifest_bytes``), a real SQLite registry row; the version's files are not needed (the claim
lives in the manifest alone, ``publish/released_rounds.py``)."""

from __future__ import annotations

import hashlib
import json
import math
import uuid
from pathlib import Path
from typing import Any

import pytest

from nimmer_train.artifacts import MANIFEST
from nimmer_train.cli import main
from nimmer_train.memory import contributions
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.publish.manifest import FORMAT, SIGNATURE, manifest_bytes
from nimmer_train.publish.registry import Registry
from nimmer_train.publish.released_rounds import federation_releases
from nimmer_train.publish.signing import Keyring, generate_key, load_private, sign, signature_bytes
from tests.helpers.memory import HashEmbedder

FED = "f" * 32
ADDRESS = "fl.example:9092"


def signed_version(
    releases: Path, key: Path, number: int, merged: dict[str, Any], registry_number: int | None = None
) -> str:
    """Write ``nimmerworld-base-vN`` with a manifest carrying ``merged`` as its merged_adapter,
    signed by ``key``, and register it (``registry_number``: the row's number, the label's unless
    given); returns the label."""
    label = f"nimmerworld-base-v{number}"
    manifest = {
        "format": FORMAT,
        "version_id": str(uuid.uuid4()),
        "version_label": label,
        "merged_adapter": merged,
    }
    raw = manifest_bytes(manifest)
    folder = releases / label
    folder.mkdir(parents=True)
    (folder / MANIFEST).write_bytes(raw)
    (folder / SIGNATURE).write_bytes(signature_bytes(sign(raw, load_private(key))))
    registry = Registry.open(releases, create=True)
    try:
        with registry.writing() as db:
            db.execute(
                "INSERT INTO base_model_versions (version_id, version_number, version_label, "
                "base_model_origin, training_corpus_refs, training_recipe_ref, released_at, "
                "contributors_count, blob_distribution, content_fingerprint, manifest_sha256, "
                "signing_key_id, weights_sha256) "
                "VALUES (?, ?, ?, 'o', '{}', '{}', 't', 0, '{}', ?, ?, 'k', 'w')",
                (
                    manifest["version_id"],
                    registry_number or number,
                    label,
                    uuid.uuid4().hex,
                    hashlib.sha256(raw).hexdigest(),
                ),
            )
    finally:
        registry.close()
    return label


@pytest.fixture
def keys(tmp_path: Path) -> tuple[Path, Path]:
    key = tmp_path / "keys" / "publisher.key"
    generate_key(key, tmp_path / "keys" / "trusted")
    return key, tmp_path / "keys" / "trusted"


def _merged(**over: Any) -> dict[str, Any]:
    return {"federation_id": FED, "rounds_released": [1, 2], "rounds_done": 2, "epsilon_a1_user_level": 2.4,
            "delta": 1e-5, **over}  # fmt: skip


def test_a_well_formed_claim_is_believed(tmp_path: Path, keys: tuple[Path, Path]) -> None:
    key, trusted = keys
    signed_version(tmp_path / "releases", key, 2, _merged())
    found, refused = federation_releases(tmp_path / "releases", Keyring.load(trusted))
    assert refused == [] and [(c.rounds_released, c.rounds_done, c.epsilon_a1_user_level) for c in found] == [
        ((1, 2), 2, 2.4)
    ]


@pytest.mark.parametrize(
    ("field", "value", "why"),
    [
        ("epsilon_a1_user_level", math.nan, "epsilon"),
        ("epsilon_a1_user_level", -3.0, "epsilon"),
        ("epsilon_a1_user_level", "0.1", "epsilon"),  # a string is no figure: not silently dropped
        ("delta", 2.0, "delta"),
        ("delta", math.nan, "delta"),
        ("rounds_done", 10**400, "rounds_done"),  # float() of it overflowed in every later show
        ("rounds_done", 1, "rounds_done"),  # below the last round it releases (2)
        ("rounds_released", [0, 2], "rounds_released"),
        ("rounds_released", [1, 10**30], "rounds_released"),
        ("rounds_released", [True, 2], "rounds_released"),
        ("federation_id", "", "federation_id"),
        ("federation_id", 7, "federation_id"),  # was silently read as "no federation"
        ("rounds_released", None, "rounds_released"),  # missing
    ],
    ids=[
        "nan-eps",
        "negative-eps",
        "string-eps",
        "delta-2",
        "nan-delta",
        "huge-done",
        "done-below",
        "round-0",
        "huge-round",
        "bool-round",
        "empty-id",
        "int-id",
        "missing-rounds",
    ],  # fmt: skip
)
def test_a_malformed_claim_refuses_its_version_by_name(
    tmp_path: Path, keys: tuple[Path, Path], field: str, value: Any, why: str
) -> None:
    key, trusted = keys
    signed_version(tmp_path / "releases", key, 2, _merged(**{field: value}))
    found, refused = federation_releases(tmp_path / "releases", Keyring.load(trusted))
    assert found == []
    (line,) = refused
    assert line.startswith("nimmerworld-base-v2:") and why in line


def test_a_registry_row_renumbering_a_signed_version_is_refused(
    tmp_path: Path, keys: tuple[Path, Path]
) -> None:
    """A copied releases folder whose registry calls v5's signed manifest version 1 would make it the
    first version to release the device's rounds: the number is the signed label's."""
    key, trusted = keys
    signed_version(tmp_path / "releases", key, 5, _merged(), registry_number=1)
    found, refused = federation_releases(tmp_path / "releases", Keyring.load(trusted))
    assert found == [] and "number 1" in refused[0]


def test_contributions_refuses_a_nan_epsilon_version_and_keeps_the_servers_spend(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    key, trusted = keys
    player = tmp_path / "me"
    generate_player(player, HashEmbedder(), seed=3, entries=5, tier="A1_federated")
    for r, done in ((1, 0), (2, 1)):
        contributions.record(
            player, "round", federation=ADDRESS, federation_id=FED, round=r, tier="A1_federated", left="u",
            examples_used=3, epsilon=1.0 * r, epsilon_local=2.0, delta=1e-5,
            outcome={"rounds_done": done, "not_released": []},
        )  # fmt: skip
    signed_version(tmp_path / "releases", key, 2, _merged(epsilon_a1_user_level=math.nan))
    before = (player / contributions.LOG_FILE).read_bytes()
    argv = [
        "contributions",
        str(player),
        "--releases",
        str(tmp_path / "releases"),
        "--trusted-keys",
        str(trusted),
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "refused nimmerworld-base-v2" in err and "epsilon" in err
    assert (player / contributions.LOG_FILE).read_bytes() == before
    assert contributions.spend(player)[FED]["epsilon"] == 1.0  # round 1, as the server told
    assert "NaN" not in json.dumps(contributions.entries(player))


def test_a_releases_folder_whose_registry_is_no_database_is_refused_and_the_log_still_shows(
    tmp_path: Path, keys: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``--releases`` naming a folder with a corrupt (or foreign) registry.sqlite: one line naming
    it, exit 1, and the device's log still shown (it was a traceback, and no log)."""
    _, trusted = keys
    player = tmp_path / "me"
    generate_player(player, HashEmbedder(), seed=3, entries=5, tier="A1_federated")
    contributions.record(
        player, "round", federation=ADDRESS, federation_id=FED, round=1, tier="A1_federated", left="u",
        examples_used=3, epsilon=1.0, epsilon_local=2.0, delta=1e-5,
        outcome={"rounds_done": 0, "not_released": []},
    )  # fmt: skip
    (tmp_path / "releases").mkdir()
    (tmp_path / "releases" / "registry.sqlite").write_bytes(b"not a database " * 100)
    argv = [
        "contributions",
        str(player),
        "--releases",
        str(tmp_path / "releases"),
        "--trusted-keys",
        str(trusted),
    ]
    assert main(argv) == 1
    captured = capsys.readouterr()
    (err,) = captured.err.strip().splitlines()
    assert "registry.sqlite" in err and "not a readable version registry" in err
    assert f"round 1 of {ADDRESS}" in captured.out
