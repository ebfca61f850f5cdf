"""``nimmer versions pull MIRROR --version newest|ALIAS|vN`` (issue 42): the mirror's releases
folder carries a signed index (publish/index.py) that names each version's manifest sha256, its
aliases and the newest; a device follows it over real HTTP on loopback (the Mirror of
test_versions_pull.py). A changed index, an unknown alias, a manifest other than the one the
index names and an index older than one the device already read are each refused with one line,
before any version file is fetched."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nimmer_train.cli import main
from nimmer_train.publish.index import INDEX, write_index
from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.publish.pull import pull_version
from nimmer_train.publish.registry import REGISTRY_FILE, Registry
from nimmer_train.publish.signing import Keyring
from tests.helpers.loopback import serve_app
from tests.unit.publish.test_versions_pull import V1, V2, Mirror, publisher  # noqa: F401 - the fixture


@pytest.fixture
def mirror(publisher: tuple[Path, Path], tmp_path: Path) -> tuple[Path, Path, Path]:  # noqa: F811
    """(mirror releases, its signing key, trusted keys): a copy of the publisher's v1 and v2 with
    the signed index publish writes, production promoted to v1 through the CLI (which re-signs it)."""
    releases, trusted = publisher
    copy = tmp_path / "mirror" / "releases"
    shutil.copytree(releases, copy)
    key = releases.parent / "keys" / "publisher.key"
    write_index(copy, key)
    promote = ["versions", "--releases", str(copy), "promote", "v1", "--signing-key", str(key)]
    assert main(promote) == 0
    return copy, key, trusted


def _pull(device: Path, trusted: Path, source: str, *options: str) -> int:
    argv = ["versions", "--releases", str(device), "--trusted-keys", str(trusted), "pull", source]
    return main([*argv, *options])


def _aliases(device: Path) -> dict[str, str]:
    registry = Registry.open(device)
    try:
        return registry.aliases()
    finally:
        registry.close()


def _index(releases: Path) -> dict:
    return json.loads((releases / INDEX).read_text())


def test_pull_follows_the_mirrors_production_then_newest(
    mirror: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, key, trusted = mirror
    index = _index(releases)["index"]
    assert (index["aliases"]["production"], index["newest"], index["sequence"]) == (V1, V2, 2)
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, f"{url}/") == 0  # a mirror without --version: its production
        assert _aliases(device) == {"production": V1}
        assert "production is nimmerworld-base-v1" in capsys.readouterr().out
        assert _pull(device, trusted, url, "--version", "newest") == 0
        assert _aliases(device) == {"production": V2}
        assert _pull(device, trusted, url, "--version", "candidate") == 0  # already here: no alias moves
        assert _aliases(device) == {"production": V2}
    assert main(["versions", "--releases", str(releases), "promote", "v2", "--signing-key", str(key)]) == 0
    assert _index(releases)["index"]["aliases"]["production"] == V2  # promote re-signed the index
    assert _pull(tmp_path / "usb" / "releases", trusted, str(releases), "--version", "v1") == 0  # a path


def test_an_unknown_alias_and_a_version_url_with_version_are_one_line_each(
    mirror: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, _, trusted = mirror
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url, "--version", "stable") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "has no alias 'stable' (its aliases: candidate, production)" in err[0]
        assert _pull(device, trusted, f"{url}/{V1}", "--version", "newest") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "give the mirror's releases folder" in err[0]
    assert not (device / REGISTRY_FILE).exists()


def test_a_changed_index_is_refused_before_any_version_file(
    mirror: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, _, trusted = mirror
    envelope = _index(releases)
    envelope["index"]["aliases"]["production"] = V2  # the mirror moves production on its own
    (releases / INDEX).write_text(json.dumps(envelope))
    device = tmp_path / "device" / "releases"
    app = Mirror(releases)
    with serve_app(app) as url:
        assert _pull(device, trusted, url) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "index" in err[0] and "signature does not verify" in err[0]
    assert [path for path, _, _ in app.log] == [f"/{INDEX}"]  # nothing else was asked for
    (releases / INDEX).write_text("{not json")
    assert _pull(device, trusted, str(releases)) == 1
    assert "is not a readable signed index" in capsys.readouterr().err


def test_a_manifest_other_than_the_indexed_one_is_refused(
    mirror: tuple[Path, Path, Path], tmp_path: Path
) -> None:
    releases, _, trusted = mirror
    device = tmp_path / "device" / "releases"
    with pytest.raises(IntegrityError, match="is not the manifest the mirror's signed index names"):
        pull_version(device, str(releases / V1), Keyring.load(trusted), manifest_sha256="0" * 64)
    assert not (device / V1).exists()


def test_an_index_older_than_one_already_read_is_refused(
    mirror: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, key, trusted = mirror
    old = (releases / INDEX).read_bytes()  # sequence 2: production is v1
    assert main(["versions", "--releases", str(releases), "promote", "v2", "--signing-key", str(key)]) == 0
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url) == 0  # sequence 3: production is v2
        (releases / INDEX).write_bytes(old)  # a stale mirror serves the old, validly signed index
        assert _pull(device, trusted, url, "--version", "production", "--no-alias") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sequence 2" in err[0] and "older than sequence 3" in err[0]
    assert _aliases(device) == {"production": V2}


def test_promote_without_the_signing_key_moves_nothing(
    mirror: tuple[Path, Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, _, _ = mirror
    before = (releases / INDEX).read_bytes()
    missing = tmp_path / "elsewhere" / "publisher.key"
    assert (
        main(["versions", "--releases", str(releases), "promote", "v2", "--signing-key", str(missing)]) == 1
    )
    assert "no signing key at" in capsys.readouterr().err
    assert _aliases(releases)["production"] == V1 and (releases / INDEX).read_bytes() == before
