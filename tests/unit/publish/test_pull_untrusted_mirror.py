"""A mirror is trusted with nothing before the signature check: ``versions pull`` follows its
redirects only within the mirror's origin (a redirect to another host or port is refused
unrequested, so a mirror cannot make the device send a blind GET to an internal service), and a
signature file nested too deep for the JSON parser is a clear error naming the file, never a
traceback. Real HTTP on loopback: the Mirror of test_versions_pull.py and a second server that
records what reaches it."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse
from starlette.routing import Route

from nimmer_train.cli import main
from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.publish.pull import PullError, pull_version
from nimmer_train.publish.signing import Keyring
from tests.helpers.loopback import serve_app
from tests.unit.publish.test_versions_pull import V1, Mirror, publisher  # noqa: F401 - the fixture

ADMIN = "/internal/admin/reset"


class Redirecting:
    """The Mirror, except that a path ``moved`` maps to an address answers 302 to it."""

    def __init__(self, mirror: Mirror, moved: Callable[[str], str | None]) -> None:
        self.mirror, self.moved = mirror, moved

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        target = self.moved(scope.get("path", ""))
        if scope["type"] == "http" and target is not None:
            return await RedirectResponse(target, status_code=302)(scope, receive, send)
        return await self.mirror(scope, receive, send)


def _internal_service() -> tuple[Starlette, list[str]]:
    """A service the device can reach that no mirror should make it call; it records each request."""
    seen: list[str] = []

    async def reset(request: Request) -> PlainTextResponse:
        seen.append(str(request.url))
        return PlainTextResponse("everything was reset")

    return Starlette(routes=[Route(ADMIN, reset, methods=["GET", "POST"])]), seen


def _pull_cli(device: Path, trusted: Path, source: str) -> int:
    return main(["versions", "--releases", str(device), "--trusted-keys", str(trusted), "pull", source])


def test_a_redirect_to_another_origin_is_refused_unrequested(
    publisher: tuple[Path, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    service, seen = _internal_service()
    with serve_app(service) as internal:
        moved = {f"/{V1}/manifest.json": f"{internal}{ADMIN}?all=1"}.get
        with serve_app(Redirecting(Mirror(releases), moved)) as url:
            with pytest.raises(PullError, match="another origin"):
                pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
            assert _pull_cli(device, trusted, f"{url}/{V1}") == 1
    assert seen == []  # the internal service was never called
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "another origin" in err and ADMIN in err, err
    assert not (device / V1).exists()


def test_a_redirect_within_the_mirror_is_followed(
    publisher: tuple[Path, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    mirror = Mirror(releases)

    def moved(path: str) -> str | None:  # the whole releases folder moved from /old/ to /
        return path.removeprefix("/old") if path.startswith("/old/") else None

    with serve_app(Redirecting(mirror, moved)) as url:
        got = pull_version(device, f"{url}/old/{V1}", Keyring.load(trusted))
    assert got.label == V1 and (device / V1).is_dir()
    assert (f"/{V1}/manifest.json", None, 200) in mirror.log
    assert any(path.startswith("/loras/") for path, _, _ in mirror.log)  # the LoRAs, beside it


def test_a_signature_nested_too_deep_is_a_clear_error_naming_the_file(
    publisher: tuple[Path, Path],  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    releases, trusted = publisher
    mirror_dir = tmp_path / "mirror"
    shutil.copytree(releases / V1, mirror_dir / V1)
    (mirror_dir / V1 / "manifest.sig").write_text("[" * 100_000 + "]" * 100_000)
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(mirror_dir)) as url:
        with pytest.raises(IntegrityError, match=r"manifest\.sig.*nested"):
            pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
        assert _pull_cli(device, trusted, f"{url}/{V1}") == 1
    assert _pull_cli(device, trusted, str(mirror_dir / V1)) == 1  # a local path too
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2 and all(line.startswith("error: ") and "manifest.sig" in line for line in lines)
    assert not (device / V1).exists()
