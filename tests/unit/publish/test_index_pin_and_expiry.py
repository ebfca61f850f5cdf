"""The two signed-index gaps of issue 42, closed and attacked over real HTTP on loopback:

(a) an older index re-served under ANOTHER index_id (an earlier releases folder signed with the
same key) used to escape the sequence check, so a ``newest`` pull could be rolled back. A device
now pins the publisher's index_id at its first mirror pull, whatever the mirror, and refuses
another id unless the operator names it (``--accept-index-id``).

(b) a frozen mirror (serving the last index it got, validly signed, forever) went unnoticed. An
index now carries ``expires_at`` (issued_at + the releases folder's validity, 14 days unless
``nimmer versions sign-index --validity-days`` set another); an expired index, or one without
``expires_at``, is refused by name with what to do; ``--allow-expired-index`` reads it anyway
(an offline copy), every other check still running."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from nimmer_train.cli import main
from nimmer_train.publish.index import INDEX, PIN_SETTING, VALIDITY_DAYS, expired
from nimmer_train.publish.registry import Registry
from tests.helpers.loopback import serve_app
from tests.unit.publish.test_pull_by_alias_or_newest import _aliases, _index, _pull, mirror  # noqa: F401
from tests.unit.publish.test_pull_index_attacks import _resign
from tests.unit.publish.test_versions_pull import V1, V2, Mirror, publisher  # noqa: F401


def _registered(device: Path) -> list[str]:
    registry = Registry.open(device)
    try:
        return [v.label for v in registry.versions()]
    finally:
        registry.close()


def _pin(device: Path) -> str | None:
    registry = Registry.open(device)
    try:
        return registry.setting(PIN_SETTING)
    finally:
        registry.close()


def _older_release_folder(old: dict[str, Any]) -> dict[str, Any]:
    """The publisher's earlier releases folder as its index said: only v1, under its own id."""
    forged = {**old, "index_id": str(uuid.uuid4()), "sequence": 7}
    forged.update(
        versions=[v for v in old["versions"] if v["label"] == V1], newest=V1, aliases={"production": V1}
    )
    return forged


def test_a_newest_pull_is_not_rolled_back_by_an_older_index_under_another_id(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The alias check does not help here: the device follows production (v1), so a ``newest``
    that says v1 moves nothing backwards; only the pinned index_id tells that this index is not
    the publisher's current one (v2 is newest). A second mirror URL is refused alike."""
    releases, key, trusted = mirror
    genuine = _index(releases)["index"]
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url) == 0  # production: v1; pins the publisher's index_id
        assert _pin(device) == genuine["index_id"]
        forged = _older_release_folder(genuine)
        _resign(releases, key, forged)
        with serve_app(Mirror(releases)) as other:  # any mirror: the pin is the device's
            for where in (url, other):
                assert _pull(device, trusted, where, "--version", "newest", "--no-alias") == 1
                (err,) = capsys.readouterr().err.strip().splitlines()
                assert f"is index_id {forged['index_id']}" in err and genuine["index_id"] in err
                assert f"--accept-index-id {forged['index_id']}" in err
    assert _registered(device) == [V1] and _aliases(device) == {"production": V1}
    assert _pin(device) == genuine["index_id"]


def test_the_operator_accepts_a_new_index_id_by_naming_it(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, key, trusted = mirror
    genuine = _index(releases)["index"]
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url) == 0
        moved = {**genuine, "index_id": str(uuid.uuid4()), "sequence": 1}  # a new releases folder
        _resign(releases, key, moved)
        wrong = str(uuid.uuid4())
        assert _pull(device, trusted, url, "--version", "newest", "--accept-index-id", wrong) == 1
        assert "--accept-index-id" in capsys.readouterr().err
        assert _pull(device, trusted, url, "--version", "newest", "--accept-index-id", moved["index_id"]) == 0
        assert _aliases(device) == {"production": V2}
        assert _pin(device) == moved["index_id"]
        _resign(releases, key, genuine)  # the old folder is now the foreign one
        assert _pull(device, trusted, url, "--version", "newest") == 1
        assert f"is index_id {genuine['index_id']}" in capsys.readouterr().err


def test_a_device_that_pulled_before_pins_follows_the_ids_it_recorded(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A registry from before pins (its sequences recorded, no pin) refuses an unrecorded id."""
    releases, key, trusted = mirror
    genuine = _index(releases)["index"]
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        assert _pull(device, trusted, url) == 0
        registry = Registry.open(device)
        try:
            with registry.writing():
                registry.db.execute("DELETE FROM settings WHERE key = ?", (PIN_SETTING,))
        finally:
            registry.close()
        _resign(releases, key, _older_release_folder(genuine))
        assert _pull(device, trusted, url, "--version", "newest") == 1
        assert "pinned at its first pull" in capsys.readouterr().err


def test_a_frozen_mirrors_expired_index_is_refused_by_name(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The mirror froze 20 days ago: it serves the last index it got, validly signed, whose
    newest was v1 (the publisher has moved on). Refused with what to do; nothing fetched."""
    releases, key, trusted = mirror
    genuine = _index(releases)["index"]
    issued = datetime.now(UTC).replace(microsecond=0) - timedelta(days=20)
    frozen = {
        **_older_release_folder(genuine),
        "index_id": genuine["index_id"],
        "sequence": genuine["sequence"],
    }
    frozen.update(issued_at=issued.isoformat(), expires_at=(issued + timedelta(days=14)).isoformat())
    _resign(releases, key, frozen)
    device = tmp_path / "device" / "releases"
    app = Mirror(releases)
    with serve_app(app) as url:
        assert _pull(device, trusted, url, "--version", "newest") == 1
        (err,) = capsys.readouterr().err.strip().splitlines()
        assert f"it expired at {frozen['expires_at']}" in err and "the mirror may be frozen" in err
        assert "nimmer versions sign-index" in err and "--allow-expired-index" in err
        # nothing but the index was asked for (the Mirror logs a request once its response is out:
        # under load the refusal can come before the index's entry, so this reads "at most")
        assert {path for path, _, _ in app.log} <= {f"/{INDEX}"}
        # an offline copy the operator trusts: read on purpose, every other check still runs
        assert _pull(device, trusted, url, "--version", "newest", "--allow-expired-index") == 0
        assert _aliases(device) == {"production": V1}


def test_an_index_without_expires_at_is_refused_as_unbounded(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An index signed before indexes expired would be a frozen mirror's forever-valid replay."""
    releases, key, trusted = mirror
    legacy = dict(_index(releases)["index"])
    legacy.pop("expires_at")
    _resign(releases, key, legacy)
    with serve_app(Mirror(releases)) as url:
        assert _pull(tmp_path / "device" / "releases", trusted, url, "--version", "newest") == 1
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert "it has no expires_at" in err
    bad = {**legacy, "expires_at": "next tuesday"}
    _resign(releases, key, bad)
    assert _pull(tmp_path / "device" / "releases", trusted, str(releases), "--version", "newest") == 1
    assert "expires_at 'next tuesday' is not a UTC time" in capsys.readouterr().err


def test_sign_index_renews_the_expiry_with_the_configured_validity(
    mirror: tuple[Path, Path, Path],  # noqa: F811
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, key, _ = mirror
    first = _index(releases)["index"]
    span = datetime.fromisoformat(first["expires_at"]) - datetime.fromisoformat(first["issued_at"])
    assert span == timedelta(days=VALIDITY_DAYS) and expired(first) is None
    sign = ["versions", "--releases", str(releases), "sign-index", "--signing-key", str(key)]
    assert main([*sign, "--validity-days", "2"]) == 0
    assert "expires" in capsys.readouterr().out
    assert main(sign) == 0  # the validity is kept for later indexes (and promote's, publish's)
    index = _index(releases)["index"]
    span = datetime.fromisoformat(index["expires_at"]) - datetime.fromisoformat(index["issued_at"])
    assert (span, index["sequence"], index["versions"]) == (
        timedelta(days=2),
        first["sequence"] + 2,
        first["versions"],
    )
    assert expired(index, now=datetime.fromisoformat(index["issued_at"]) + timedelta(days=3)) is not None
    assert main([*sign, "--validity-days", "0"]) == 1
    assert "give a number of days" in capsys.readouterr().err
    assert json.loads((releases / INDEX).read_text())["index"]["sequence"] == first["sequence"] + 2
