"""What ``publish/released_rounds.py`` believes of a device's versions (the word a contributor's
log takes on its federation's released rounds): only a manifest whose signature verifies AND
which is the very manifest the registry recorded when the version was published or pulled; a
validly signed manifest swapped in (the publisher's own, made for another purpose), a symlink and
an unknown key are refused by name; a version that names no federation says nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nimmer_train.artifacts import MANIFEST
from nimmer_train.publish.manifest import SIGNATURE, manifest_bytes
from nimmer_train.publish.released_rounds import federation_releases
from nimmer_train.publish.signing import Keyring, load_private, sign, signature_bytes
from tests.unit.publish.test_versions_pull import V1, V2, publisher  # noqa: F401 - the fixture


@pytest.fixture
def device(publisher: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, Path]:  # noqa: F811
    """(a copy of the publisher's releases, its signing key, trusted keys)."""
    releases, trusted = publisher
    copy = tmp_path / "releases"
    shutil.copytree(releases, copy)
    return copy, releases.parent / "keys" / "publisher.key", trusted


def _claiming(folder: Path, key: Path, federation_id: str) -> None:
    """Re-sign ``folder``'s manifest, validly, with a federation claim in it."""
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["merged_adapter"] = {
        "federation_id": federation_id,
        "rounds_released": [1, 2, 3],
        "rounds_done": 3,
    }
    raw = manifest_bytes(manifest)
    (folder / MANIFEST).write_bytes(raw)
    (folder / SIGNATURE).write_bytes(signature_bytes(sign(raw, load_private(key))))


def test_versions_without_a_federation_say_nothing(device: tuple[Path, Path, Path]) -> None:
    releases, _, trusted = device
    assert federation_releases(releases, Keyring.load(trusted)) == ([], [])
    assert federation_releases(releases / "nowhere", Keyring.load(trusted)) == ([], [])


def test_a_validly_signed_manifest_other_than_the_registered_one_is_refused(
    device: tuple[Path, Path, Path],
) -> None:
    releases, key, trusted = device
    _claiming(releases / V2, key, "f" * 32)
    found, refused = federation_releases(releases, Keyring.load(trusted))
    assert found == []
    (line,) = refused
    assert line.startswith(f"{V2}:") and "is not the manifest registered for" in line


def test_a_changed_manifest_an_unknown_key_and_a_symlink_are_refused(
    device: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    releases, _, trusted = device
    text = (releases / V2 / MANIFEST).read_text()
    (releases / V2 / MANIFEST).write_text(text.replace('"merged_adapter": null', '"merged_adapter": {}'))
    if (releases / V2 / MANIFEST).read_text() == text:  # the manifest is compact: change a byte
        (releases / V2 / MANIFEST).write_text(text + " ")
    empty = tmp_path / "no-keys"
    empty.mkdir()
    assert "not a trusted publisher key" in federation_releases(releases, Keyring.load(empty))[1][0]
    found, refused = federation_releases(releases, Keyring.load(trusted))
    assert found == [] and len(refused) == 1 and "signature does not verify" in refused[0]
    (releases / V1 / MANIFEST).rename(tmp_path / "v1-manifest.json")
    (releases / V1 / MANIFEST).symlink_to(tmp_path / "v1-manifest.json")
    refused = federation_releases(releases, Keyring.load(trusted))[1]
    assert any(line.startswith(f"{V1}:") and "not a regular file" in line for line in refused)
