"""Versions reach players (issue 25, item 4): ``nimmer versions pull`` from a real HTTP mirror
(uvicorn on loopback serving the publisher's releases folder with Starlette's StaticFiles, Range
requests included) or a local path; a flipped byte never becomes visible; a pull cut off mid-file
continues from its partial file; Ring A takes the newly pulled production version at the next
session; ``nimmer serve`` follows the alias while a turn is in flight, and that turn completes."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Mount
from starlette.staticfiles import StaticFiles

import nimmer_train.publish.pull
from nimmer_train.artifacts import read_manifest, write_manifest
from nimmer_train.cli import main
from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.publish.pull import PULLS, PullError, pull_version
from nimmer_train.publish.registry import REGISTRY_FILE, Registry
from nimmer_train.publish.signing import Keyring, SignatureError
from nimmer_train.publish.versions import open_version
from nimmer_train.runtime.openai_server import Reload, create_app
from nimmer_train.runtime.rings import RingA, RingB, RingConfig
from nimmer_train.voice.prompt_dsl import AffectState, MemoryScope, TurnPrompt
from nimmer_train.voice.registers import load_catalogue
from nimmer_train.voice.sampling import SamplingKnobs
from tests.helpers.loopback import serve_app

V1, V2 = "nimmerworld-base-v1", "nimmerworld-base-v2"
REGISTER = "caste-preacher"
WEIGHTS = f"/{V1}/model.safetensors"


class Mirror:
    """An ASGI app serving ``folder`` (StaticFiles: 206 for a Range) that records every request
    as (path, Range header, status) and, for a path in ``cut``, drops the connection once after
    that many body bytes (a download killed mid-file)."""

    def __init__(self, folder: Path) -> None:
        self.app = Starlette(routes=[Mount("/", StaticFiles(directory=folder))])
        self.log: list[tuple[str, str | None, int | None]] = []
        self.cut: dict[str, int] = {}

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status, sent = scope["path"], {}, 0
        rng = dict(scope["headers"]).get(b"range")
        cut = self.cut.pop(path, None)

        async def watched(message: dict) -> None:
            nonlocal sent
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            body = message.get("body", b"")
            if message["type"] == "http.response.body" and cut is not None and sent + len(body) >= cut:
                await send({**message, "body": body[: cut - sent], "more_body": True})
                raise ConnectionAbortedError("the mirror drops the connection mid-file")
            sent += len(body)
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            self.log.append((path, rng.decode() if rng else None, status.get("code")))


@pytest.fixture(scope="module")
def publisher(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(releases, trusted keys) of a publisher with v1 and v2 (the same weights under another
    recipe, so that v2's LoRA is v1's: a pull finds it already here)."""
    from nimmer_train.publish.release import PublishRequest, publish_version
    from tests.helpers.published import publish_registers

    root = tmp_path_factory.mktemp("publisher")
    releases, trusted = publish_registers(root, registers=(REGISTER,))
    base2 = root / "base" / "tiny-serve-2"
    shutil.copytree(root / "base" / "tiny-serve", base2)
    lineage = {**read_manifest(base2)["lineage"], "git_commit": "test-2"}
    write_manifest(base2, "base", "serve-base-tiny-2", lineage)
    publish_version(
        releases, root / "keys" / "publisher.key", PublishRequest(base2, [root / "adapters" / REGISTER])
    )
    return releases, trusted


def _production(device: Path) -> str:
    registry = Registry.open(device)
    try:
        return registry.find("production").label
    finally:
        registry.close()


def test_pull_over_http_verifies_registers_and_moves_production(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    with serve_app(Mirror(releases)) as url:
        argv = ["versions", "--releases", str(device), "--trusted-keys", str(trusted), "pull", f"{url}/{V1}/"]
        assert main(argv) == 0
    version = open_version(device, "production", Keyring.load(trusted))  # signature + every file again
    assert (version.label, sorted(version.loras)) == (V1, [REGISTER])
    assert not any((device / PULLS).iterdir())  # the staging folder is gone
    got = pull_version(device, str(releases / V2), Keyring.load(trusted))  # a local path (USB stick)
    assert (got.label, got.already, _production(device)) == (V2, False, V2)
    assert sorted(open_version(device, V2, Keyring.load(trusted)).loras) == [REGISTER]  # shared LoRA
    rollback = {"allow_downgrade": True}  # production is v2: moving it back to v1 is asked for
    again = pull_version(device, str(releases / V1), Keyring.load(trusted), **rollback)
    assert (again.already, again.fetched_bytes, _production(device)) == (True, 0, V1)


def test_a_flipped_byte_never_becomes_visible(publisher: tuple[Path, Path], tmp_path: Path) -> None:
    releases, trusted = publisher
    mirror_dir = tmp_path / "mirror"
    shutil.copytree(releases, mirror_dir)
    weights = mirror_dir / V1 / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    device = tmp_path / "device" / "releases"
    mirror = Mirror(mirror_dir)
    with serve_app(mirror) as url:
        with pytest.raises(IntegrityError, match=r"model\.safetensors.*does not match its signed sha256"):
            pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
        assert not (device / V1).exists() and not (device / REGISTRY_FILE).exists()
        assert not list((device / PULLS).rglob("model.safetensors"))  # the bad bytes are discarded
        assert main(["versions", "--releases", str(device), "verify", "production"]) == 1

        data[len(data) // 2] ^= 0x01  # the mirror repaired: the next pull keeps the good files
        weights.write_bytes(bytes(data))
        got = pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
        assert got.label == V1 and got.resumed_bytes > 0 and _production(device) == V1

        manifest = mirror_dir / V2 / "manifest.json"  # one byte of the manifest: its signature fails
        raw = bytearray(manifest.read_bytes())
        raw[raw.index(b"nimmerworld-base-v2")] ^= 0x20
        manifest.write_bytes(bytes(raw))
        mirror.log.clear()
        with pytest.raises(SignatureError, match="does not verify"):
            pull_version(device, f"{url}/{V2}", Keyring.load(trusted))
    assert [p for p, _, _ in mirror.log] == [f"/{V2}/manifest.json", f"/{V2}/manifest.sig"]  # nothing more
    assert not (device / V2).exists() and _production(device) == V1


def test_a_pull_cut_off_mid_file_continues_from_its_partial_file(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    size = (releases / WEIGHTS.lstrip("/")).stat().st_size
    device = tmp_path / "device" / "releases"
    mirror = Mirror(releases)
    mirror.cut[WEIGHTS] = size // 3
    with serve_app(mirror) as url:
        with pytest.raises(PullError, match=r"stopped after .* run the same pull again"):
            pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
        (partial,) = (device / PULLS).rglob("model.safetensors")
        kept = partial.stat().st_size
        assert 0 < kept <= size // 3 and not (device / V1).exists() and not (device / REGISTRY_FILE).exists()
        mirror.log.clear()
        got = pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
    assert (WEIGHTS, f"bytes={kept}-", 206) in mirror.log  # continued, not from zero
    assert got.resumed_bytes >= kept and got.fetched_bytes < sum(
        f["size"] for f in read_manifest_files(releases / V1)
    )
    assert open_version(device, "production", Keyring.load(trusted)).label == V1


def read_manifest_files(folder: Path) -> list[dict[str, Any]]:
    return json.loads((folder / "manifest.json").read_text())["blob_distribution"]["files"]


def _prompt() -> tuple[TurnPrompt, Any]:
    register = load_catalogue().get(REGISTER)
    prompt = TurnPrompt(
        role=register.role,
        trait_vector=register.traits,
        affect_state=AffectState("calm"),
        memory_scope=MemoryScope(),
        turn_intent="answer",
        zone_context="the gate",
        player_utterance="Well?",
    )
    return prompt, register


def test_ring_a_takes_the_pulled_production_version_at_the_next_session(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    pull_version(device, str(releases / V1), Keyring.load(trusted))
    prompt, register = _prompt()
    knobs = SamplingKnobs(0.7, 0.9, 40, 1.1, 0.0, max_new_tokens=6)
    first = RingA.open(device, "production", trusted, constrained=False)
    try:
        pull_version(device, str(releases / V2), Keyring.load(trusted))  # production moves mid-session
        assert _production(device) == V2
        assert first.model.label == V1  # a session keeps the version it started with
        assert first.speak(prompt, register, REGISTER, knobs).adapter == REGISTER
    finally:
        first.model.close()
    second = RingA.open(device, "production", trusted, constrained=False)  # the next session
    try:
        assert second.model.label == V2
        reply = second.speak(prompt, register, REGISTER, knobs)
        assert (reply.ring, reply.adapter, reply.error) == ("A", REGISTER, None)
    finally:
        second.model.close()


def _wait(predicate: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_serve_follows_the_alias_and_the_turn_in_flight_completes(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    pull_version(device, str(releases / V1), Keyring.load(trusted))
    reload = Reload.alias(device, "production", trusted, interval_s=0.1)
    app = create_app(lambda: reload.load(reload.resolve()), reload=reload)
    body = {
        "model": f"{V1}:{REGISTER}",
        "messages": [{"role": "user", "content": "Speak of the gate."}],
        "max_tokens": 8,
        "seed": 1,
        "stream": True,
    }
    gate, started, lines = threading.Event(), threading.Event(), []
    with serve_app(app) as url:
        _wait(lambda: httpx.get(f"{url}/health").status_code == 200, "the model to load")
        old = app.state.holder.model
        old.engine.call(gate.wait)  # the old engine holds still: the turn stays in flight
        ring_b = RingB(RingConfig(ring="B", base_url=f"{url}/v1", constrained=False))
        assert ring_b.model_id(REGISTER) == f"{V1}:{REGISTER}"  # a Ring B client that knows v1

        def stream() -> None:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=60) as reply:
                for line in reply.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()

        client = threading.Thread(target=stream)
        client.start()
        try:
            assert started.wait(30)  # the turn was accepted and its reply has begun
            pull_version(device, str(releases / V2), Keyring.load(trusted))  # production -> v2
            _wait(lambda: httpx.get(f"{url}/health").json().get("model") == V2, "the swap to v2")
            new = httpx.post(
                f"{url}/v1/chat/completions", json={**body, "model": f"{V2}:{REGISTER}", "stream": False}
            )
            assert new.status_code == 200 and new.json()["system_fingerprint"] == f"{V2}:{REGISTER}"
            assert not lines[-1].endswith("[DONE]")  # still in flight on v1, whose model stays open
            assert old.engine.alive and not old.engine.closing
            prompt, register = _prompt()
            knobs = SamplingKnobs(0.7, 0.9, 40, 1.1, 0.0, max_new_tokens=6)
            assert ring_b.speak(prompt, register, REGISTER, knobs).error is None  # asked again: v2
            assert ring_b.model_id(REGISTER) == f"{V2}:{REGISTER}"
        finally:
            gate.set()
            client.join(60)
        _wait(lambda: not old.engine.alive, "the old model to close after its last turn")
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    assert {c["system_fingerprint"] for c in chunks} == {f"{V1}:{REGISTER}"}  # spoken by v1 throughout
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_serve_started_before_the_first_pull_serves_it_once_pulled(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"  # nothing pulled yet: no registry at all
    reload = Reload.alias(device, "production", trusted, interval_s=0.1)
    app = create_app(lambda: reload.load(reload.resolve()), reload=reload)
    with serve_app(app) as url:
        _wait(lambda: httpx.get(f"{url}/health").json().get("status") == "error", "the first load to fail")
        assert httpx.get(f"{url}/v1/models").status_code == 503
        pull_version(device, str(releases / V1), Keyring.load(trusted))
        _wait(lambda: httpx.get(f"{url}/health").json().get("model") == V1, "v1 to be served")
        assert f"{V1}:{REGISTER}" in [m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]]


def _staging(releases: Path, device: Path, label: str) -> Path:
    """The staging folder a pull of ``label`` uses: releases/.pulls/<label>-<manifest sha[:16]>."""
    digest = hashlib.sha256((releases / label / "manifest.json").read_bytes()).hexdigest()
    return device / PULLS / f"{label}-{digest[:16]}"


def _aliases(device: Path) -> dict[str, str]:
    registry = Registry.open(device)
    try:
        return registry.aliases()
    finally:
        registry.close()


def test_pull_refuses_a_manifest_whose_label_is_not_the_sources(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    mirror = tmp_path / "mirror"
    shutil.copytree(releases / V1, mirror / "nimmerworld-base-v9")  # validly signed v1, served as v9
    device = tmp_path / "device" / "releases"
    with pytest.raises(PullError, match=r"names nimmerworld-base-v9, but its signed manifest is " + V1):
        pull_version(device, str(mirror / "nimmerworld-base-v9"), Keyring.load(trusted))
    assert not device.exists()  # refused before anything was fetched or staged


def test_pull_of_an_older_version_does_not_move_production_backwards(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    pull_version(device, str(releases / V2), Keyring.load(trusted))
    assert _aliases(device) == {"production": V2}  # a pull never sets candidate
    registry = Registry.open(device)
    try:
        registry.set_alias("candidate", registry.find(V2), "2026-01-01T00:00:00+00:00")
    finally:
        registry.close()
    with pytest.raises(PullError, match=rf"production is {V2} here and {V1} is older.*--allow-downgrade"):
        pull_version(device, str(releases / V1), Keyring.load(trusted))
    assert not (device / V1).exists()
    got = pull_version(device, str(releases / V1), Keyring.load(trusted), alias=None)  # only registered
    assert got.label == V1 and not got.already
    assert _aliases(device) == {"production": V2, "candidate": V2}  # neither moved
    argv = ["versions", "--releases", str(device), "--trusted-keys", str(trusted), "pull"]
    assert main([*argv, str(releases / V1), "--allow-downgrade"]) == 0  # a rollback on purpose
    assert _aliases(device) == {"production": V1, "candidate": V2}


def test_a_symlink_in_the_staging_folder_is_refused_and_its_target_untouched(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"outside releases/")
    staged = _staging(releases, device, V1) / "version"
    staged.mkdir(parents=True)
    (staged / "config.json").symlink_to(victim)  # planted by another local user
    with pytest.raises(IntegrityError, match=r"version/config\.json in the staging folder .* is a symlink"):
        pull_version(device, str(releases / V1), Keyring.load(trusted))
    assert victim.read_bytes() == b"outside releases/" and not (device / REGISTRY_FILE).exists()
    shutil.rmtree(device / PULLS)
    (device / PULLS).symlink_to(tmp_path, target_is_directory=True)  # .pulls itself elsewhere
    with pytest.raises(IntegrityError, match=r"\.pulls is a symlink"):
        pull_version(device, str(releases / V1), Keyring.load(trusted))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["device", "victim.txt"]


def test_a_staged_file_changed_after_verification_is_not_registered(
    publisher: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    real = nimmer_train.publish.pull.fsync_tree

    def racing_writer(folder: Path) -> None:  # stands in for another process writing in the window
        if folder.name == "version":  # after verify_folder, before the lock and the rename
            (folder / "config.json").write_text('{"tampered": true}')
        real(folder)

    monkeypatch.setattr(nimmer_train.publish.pull, "fsync_tree", racing_writer)
    with pytest.raises(IntegrityError, match=r"changed after it was verified.*was discarded"):
        pull_version(device, str(releases / V1), Keyring.load(trusted))
    registry = Registry.open(device)
    try:
        assert registry.versions() == [] and not (device / V1).exists()  # nothing registered
    finally:
        registry.close()
    assert not _staging(releases, device, V1).exists()


def test_a_damaged_version_is_repaired_and_stray_or_finished_staging_is_cleaned(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    device = tmp_path / "device" / "releases"
    stray = _staging(releases, device, V1) / "version" / "stray.bin"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"left by something else")  # used to fail every later pull of v1
    got = pull_version(device, str(releases / V1), Keyring.load(trusted))
    assert got.discarded == ("version/stray.bin",) and _production(device) == V1

    weights = device / V1 / "model.safetensors"  # a flipped byte on this device
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0x01
    weights.write_bytes(bytes(data))
    (lora_file,) = [p for p in (device / "loras").rglob("*.safetensors")]
    lora_file.write_bytes(lora_file.read_bytes()[:-1])  # and a truncated LoRA file
    got = pull_version(device, str(releases / V1), Keyring.load(trusted))
    assert (got.already, got.repaired) == (False, True)
    assert sorted(open_version(device, "production", Keyring.load(trusted)).loras) == [REGISTER]

    finished = _staging(releases, device, V1) / "loras" / "x"  # a pull killed right after its COMMIT
    finished.mkdir(parents=True)
    again = pull_version(device, str(releases / V1), Keyring.load(trusted))
    assert again.already and not any((device / PULLS).iterdir())


def test_pull_asks_for_identity_and_refuses_a_content_encoded_reply(
    publisher: tuple[Path, Path], tmp_path: Path
) -> None:
    releases, trusted = publisher
    asked: list[bytes | None] = []

    async def gzipping(scope: dict, receive: Any, send: Any) -> None:
        """Serves the releases folder, gzip-encoded (a decompression bomb would be), whatever asked."""
        asked.append(dict(scope["headers"]).get(b"accept-encoding"))
        path = releases / scope["path"].lstrip("/")
        body = gzip.compress(path.read_bytes()) if path.is_file() else b""
        headers = [(b"content-encoding", b"gzip"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200 if body else 404, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    device = tmp_path / "device" / "releases"
    refused = pytest.raises(IntegrityError, match=r"Content-Encoding 'gzip' although identity was asked")
    with serve_app(gzipping) as url, refused:
        pull_version(device, f"{url}/{V1}", Keyring.load(trusted))
    assert asked == [b"identity"] and not device.exists()
