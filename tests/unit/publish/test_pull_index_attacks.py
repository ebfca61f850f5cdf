"""Adversarial review of pulling through a mirror's signed index (issue 42), over real HTTP on
loopback: a validly signed index that names a path outside the mirror, an index from another
index_id that would roll production back, a redirect to another host, a huge index, and
duplicate JSON keys around the signed bytes. Each pins what the device refuses or keeps."""

from __future__ import annotations

import json
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.responses import RedirectResponse
from starlette.routing import Route

from nimmer_train.artifacts import MANIFEST
from nimmer_train.publish.index import INDEX, MAX_INDEX_BYTES, write_index
from nimmer_train.publish.manifest import SIGNATURE, manifest_bytes
from nimmer_train.publish.signing import generate_key, load_private, sign
from tests.helpers.loopback import serve_app
from tests.unit.publish.test_pull_by_alias_or_newest import _aliases, _index, _pull, mirror  # noqa: F401
from tests.unit.publish.test_versions_pull import V1, V2, Mirror, publisher  # noqa: F401


def _resign(releases: Path, key: Path, index: dict[str, Any]) -> None:
    """Write ``index`` as the mirror's, validly signed with the publisher's key (what a mirror
    holding an old or odd signed index serves)."""
    envelope = {"index": index, "signature": sign(manifest_bytes(index), load_private(key))}
    (releases / INDEX).write_text(json.dumps(envelope))


@pytest.mark.parametrize(
    "label",
    [
        "../nimmerworld-base-v1",
        "/etc/nimmerworld-base-v1",
        "http://other.example/nimmerworld-base-v1",
        "nimmerworld-base-v1/../../x",
        "nimmerworld-base-v1?x=1",
        "nimmerworld-base-v1\n",
    ],
)
def test_pull_refuses_an_index_label_outside_the_mirror(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    label: str,
) -> None:
    releases, key, trusted = mirror
    index = _index(releases)["index"]
    index["versions"][0]["label"] = label
    index["aliases"] = {a: label if v == V1 else v for a, v in index["aliases"].items()}
    _resign(releases, key, index)
    device = tmp_path / "device" / "releases"
    app = Mirror(releases)
    with serve_app(app) as url:
        assert _pull(device, trusted, url, "--version", "production") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the index's versions are not a list" in err[0]
    assert [path for path, _, _ in app.log] == [f"/{INDEX}"]  # nothing else was asked for


def test_an_index_with_another_index_id_cannot_roll_production_back(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An index signed under a fresh index_id (another releases folder of the same key) is
    refused by the device's pinned index_id before anything else; production never moves back."""
    releases, key, trusted = mirror
    old = _index(releases)["index"]  # production v1
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url, "--version", "newest") == 0
        assert _aliases(device) == {"production": V2}
        versions = [v for v in old["versions"] if v["label"] == V1]  # as it was before v2
        forged = {**old, "index_id": str(uuid.uuid4()), "sequence": 99, "versions": versions}
        forged.update(newest=V1, aliases={"production": V1})
        _resign(releases, key, forged)
        for selector in ("newest", "production"):
            assert _pull(device, trusted, url, "--version", selector) == 1
            assert f"is index_id {forged['index_id']}" in capsys.readouterr().err
    assert _aliases(device) == {"production": V2}


def test_pull_refuses_an_index_redirected_to_another_host(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, _, trusted = mirror
    elsewhere = Mirror(releases)
    with serve_app(elsewhere) as other:
        other = other.replace("127.0.0.1", "localhost")  # another host name, same machine

        async def moved(request: Any) -> RedirectResponse:
            return RedirectResponse(f"{other}{request.url.path}", status_code=302)

        redirecting = Starlette(routes=[Route("/{path:path}", moved)])
        with serve_app(redirecting) as url:
            assert _pull(tmp_path / "device" / "releases", trusted, url, "--version", "newest") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "another origin" in err[0]
    assert elsewhere.log == []  # nothing was requested there


def test_pull_refuses_a_huge_index_unread(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, _, trusted = mirror
    with (releases / INDEX).open("ab") as fh:
        fh.write(b" " * (MAX_INDEX_BYTES + 1))
    with serve_app(Mirror(releases)) as url:
        assert _pull(tmp_path / "device" / "releases", trusted, url, "--version", "newest") == 1
    assert "larger than" in capsys.readouterr().err


def test_a_duplicate_key_outside_the_signed_bytes_changes_nothing_a_pull_uses(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The signature is checked over the canonical bytes of what was parsed: a duplicate key
    (JSON keeps the last) either leaves the signed value in place or fails the signature."""
    releases, _, trusted = mirror
    text = (releases / INDEX).read_text()
    device = tmp_path / "device" / "releases"
    real = f'"newest": "{V2}"'
    with serve_app(Mirror(releases)) as url:
        (releases / INDEX).write_text(text.replace(real, f'"newest": "{V1}", {real}'))
        assert _pull(device, trusted, url, "--version", "newest") == 0  # the last, signed, value
        assert _aliases(device) == {"production": V2}
        (releases / INDEX).write_text(text.replace(real, f'{real}, "newest": "{V1}"'))
        assert _pull(device, trusted, url, "--version", "newest") == 1
    assert "signature does not verify" in capsys.readouterr().err


def test_a_stale_index_signed_by_a_rotated_out_key_is_refused(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The publisher rotates keys (both still trusted on the device): the old key's index has a
    lower sequence of the same index_id and is refused once the new one was read."""
    releases, _, trusted = mirror
    old = (releases / INDEX).read_bytes()
    keys = tmp_path / "trusted"
    shutil.copytree(trusted, keys)
    generate_key(tmp_path / "rotated.key", keys)
    write_index(releases, tmp_path / "rotated.key")
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, keys, url, "--version", "newest") == 0
        (releases / INDEX).write_bytes(old)
        assert _pull(device, keys, url, "--version", "newest") == 1
    assert "older than sequence 3" in capsys.readouterr().err
    assert _aliases(device) == {"production": V2}


def test_a_version_folder_swapped_under_an_alias_is_refused_before_its_files(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The mirror serves v2's validly signed folder where the index's production (v1) lives."""
    releases, _, trusted = mirror
    shutil.rmtree(releases / V1)
    shutil.copytree(releases / V2, releases / V1)
    app = Mirror(releases)
    with serve_app(app) as url:
        assert _pull(tmp_path / "device" / "releases", trusted, url, "--version", "production") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and V1 in err[0]
    allowed = {f"/{INDEX}", f"/{V1}/{MANIFEST}", f"/{V1}/{SIGNATURE}"}
    assert {path for path, _, _ in app.log} <= allowed  # no version file was fetched


def test_an_index_whose_newest_is_not_its_highest_version_is_refused(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, key, trusted = mirror
    for newest in (V1, None):
        _resign(releases, key, {**_index(releases)["index"], "newest": newest})
        assert _pull(tmp_path / "device" / "releases", trusted, str(releases), "--version", "newest") == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "newest" in err[0] and "highest" in err[0]
