"""``--accept-index-id`` is the operator's override of the pinned index id, and the pin refusal
prints the exact flag to pass for whatever id the mirror serves. Misused, it must not roll a
device back, over real HTTP on loopback:

- at a first pull (nothing pinned yet) a named id the mirror does not serve is refused, instead
  of silently pinning the mirror's;
- an earlier releases folder's index (its last index, validly signed, issued before the index the
  device follows now) is refused even when the operator names its id: a folder the publisher
  really moved to is signed anew (``nimmer versions sign-index``), so its index is not older."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from pathlib import Path

import pytest

from nimmer_train.publish.index import PIN_SETTING
from nimmer_train.publish.registry import Registry
from tests.helpers.loopback import serve_app
from tests.unit.publish.test_pull_by_alias_or_newest import _aliases, _index, _pull, mirror  # noqa: F401
from tests.unit.publish.test_pull_index_attacks import _resign
from tests.unit.publish.test_versions_pull import V1, V2, Mirror, publisher  # noqa: F401


def _pin(device: Path) -> str | None:
    if not (device / "registry.sqlite").exists():
        return None
    registry = Registry.open(device)
    try:
        return registry.setting(PIN_SETTING)
    finally:
        registry.close()


def test_a_first_pull_naming_an_id_the_mirror_does_not_serve_is_refused(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, _, trusted = mirror
    served = _index(releases)["index"]["index_id"]
    device = tmp_path / "device" / "releases"
    named = str(uuid.uuid4())
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url, "--accept-index-id", named) == 1
        err = capsys.readouterr().err
        assert f"is index_id {served}, not {named}" in err
        assert _pin(device) is None  # nothing pinned, nothing fetched
        assert _pull(device, trusted, url, "--accept-index-id", served) == 0
    assert _pin(device) == served


def test_naming_an_earlier_release_folders_id_does_not_roll_newest_back(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The device followed folder A, then the publisher moved to folder B (signed an hour later,
        newest v2); a mirror re-serves A's last index (newest v1, not expired) and the operator, told
        by the refusal which flag to pass, names A's id: refused, the pin stays B (before, the pin moved
    back to A: newest read v1 and the device refused folder B from then on)."""
    releases, key, trusted = mirror
    genuine = _index(releases)["index"]  # v1 and v2, production v1
    old = {**genuine, "newest": V1, "versions": [v for v in genuine["versions"] if v["label"] == V1]}
    old["aliases"] = {"production": V1}
    # both indexes dated in the past: a moved index dated ahead of now is read as issued now
    # (``_record_seen``), which would tie with an old index issued in the same second
    issued = datetime.fromisoformat(old["issued_at"]) - timedelta(hours=2)
    old.update(issued_at=issued.isoformat(), expires_at=(issued + timedelta(days=14)).isoformat())
    _resign(releases, key, old)
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url, "--version", "newest", "--no-alias") == 0  # folder A: v1
        later = datetime.fromisoformat(old["issued_at"]) + timedelta(hours=1)
        moved = {**genuine, "index_id": str(uuid.uuid4()), "sequence": 1, "aliases": {"production": V2}}
        moved.update(issued_at=later.isoformat(), expires_at=(later + timedelta(days=14)).isoformat())
        _resign(releases, key, moved)
        assert _pull(device, trusted, url, "--version", "newest", "--accept-index-id", moved["index_id"]) == 0
        assert _pin(device) == moved["index_id"]
        _resign(releases, key, old)  # folder A's last index, validly signed, re-served
        assert _pull(device, trusted, url, "--version", "newest", "--no-alias") == 1
        capsys.readouterr()
        # --no-alias: the alias guard (production never moves back) is not what stops it
        misuse = ("--version", "newest", "--no-alias", "--accept-index-id", old["index_id"])
        assert _pull(device, trusted, url, *misuse) == 1
        err = capsys.readouterr().err
        assert "issued before the latest index this device read" in err and "sign-index" in err
    assert _pin(device) == moved["index_id"]
    assert _aliases(device) == {"production": V2}
