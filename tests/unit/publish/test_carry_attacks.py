"""Attacks on carrying LoRAs across versions (publish/rebase.py ``carry`` -> release.py signing):
registry and releases-folder edits by someone without the signing key, pulls, interrupted
publishes, and the consistency of the signed ``lora_carry`` with ``compatible_loras``. Each
test is a property that holds; the ones that failed when the review found them say so. Built on
tests/unit/publish/test_rebase.py's signed v1 (base A, two LoRAs) in seconds."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from nimmer_train.artifacts import MANIFEST, file_table, sha256_file, write_manifest
from nimmer_train.config.schema import RebaseConfig
from nimmer_train.errors import NimmerError
from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.publish.pull import pull_version
from nimmer_train.publish.rebase import Decision
from nimmer_train.publish.registry import Registry
from nimmer_train.publish.release import PublishRequest, publish_version
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.stage import _carried
from nimmer_train.publish.versions import CompatibilityError, check_lora, open_version
from tests.helpers.compose import config
from tests.unit.publish import test_rebase
from tests.unit.publish.test_rebase import REGISTERS, Published

published = test_rebase.published  # the fixture: v1 on base A with both LoRAs, signed
LENIENT = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)  # inherits anything finite
REFUSE = RebaseConfig(min_gain=1e9, min_margin=-1e9, retrain=False)  # refuses everything


def _db(releases: Path) -> sqlite3.Connection:
    return sqlite3.connect(releases / "registry.sqlite", isolation_level=None)


def _version_id(releases: Path, name: str) -> str:
    registry = Registry.open(releases)
    try:
        return registry.find(name).id
    finally:
        registry.close()


def _signed(releases: Path, label: str) -> dict[str, Any]:
    return json.loads((releases / label / MANIFEST).read_text())


def _variant(src: Path, dst: Path, fingerprint: str, scale: float) -> Path:
    """A copy of adapter ``src`` with its weights scaled and a manifest under another fingerprint
    (a manifest is unsigned: anyone who can write the folder can write one)."""
    shutil.copytree(src, dst)
    weights = dst / "adapter_model.safetensors"
    save_file({k: v * scale for k, v in load_file(weights).items()}, weights)
    (dst / MANIFEST).unlink()
    write_manifest(dst, "register_adapter", fingerprint, {})
    return dst


def _split(published: Published) -> tuple[str, dict[str, Decision]]:
    """v2 on base B: the LoRA with the larger gain inherited, the other refused (not retrained)."""
    base_b = published.base("b")
    gains = {d.register: d.evidence["gain"] for d in published.carry(base_b, LENIENT).decisions}
    low, high = sorted(gains, key=gains.get)
    middle = RebaseConfig(min_gain=(gains[low] + gains[high]) / 2, min_margin=-1e9, retrain=False)
    found = published.carry(base_b, middle)
    decided = {d.register: d for d in found.decisions}
    assert (decided[high].decision, decided[low].decision) == ("inherited-evaluated", "refused")
    return published.publish(base_b, found), decided


# --- properties that hold ------------------------------------------------------------------------


def test_the_signed_carry_matches_the_signed_loras_and_the_registry(published: Published) -> None:
    label, decided = _split(published)
    inherited, refused = (
        next(d for d in decided.values() if d.decision == k) for k in ("inherited-evaluated", "refused")
    )
    v2 = published.open(label)
    compat = {c["lora_id"]: c for c in v2.manifest["compatible_loras"]}
    assert {i: c["relation"] for i, c in compat.items()} == {inherited.lora_id: "inherited"}
    signed = {d["lora_id"]: d["decision"] for d in v2.manifest["lora_carry"]["decisions"]}
    assert signed == {d.lora_id: d.decision for d in decided.values()}
    registry = Registry.open(published.releases)
    try:
        rows = {r["lora_id"]: r["decision"] for r in registry.rebases_into(registry.find(label))}
    finally:
        registry.close()
    assert rows == signed
    assert set(v2.loras) == {inherited.register}
    with pytest.raises(CompatibilityError, match="not nimmerworld-base-v2"):
        check_lora(published.releases, label, published.releases / "loras" / refused.lora_id)


def test_registry_edits_cannot_make_a_refused_lora_load_on_the_new_version(published: Published) -> None:
    label, decided = _split(published)
    refused = next(d for d in decided.values() if d.decision == "refused")
    db = _db(published.releases)
    # the recorded decision rewritten: loading never reads lora_rebases
    db.execute(
        "UPDATE lora_rebases SET decision = 'inherited-evaluated' WHERE lora_id = ?", (refused.lora_id,)
    )
    assert set(published.open(label).loras) == {d.register for d in decided.values() if d is not refused}
    # a compat row added for it: the signed manifest does not list it, so the version is refused
    db.execute(
        "INSERT INTO lora_compat (lora_id, version_id, relation) VALUES (?, ?, 'inherited')",
        (refused.lora_id, _version_id(published.releases, label)),
    )
    with pytest.raises(IntegrityError, match="signed manifest does not"):
        published.open(label)


def test_a_publish_that_dies_while_recording_the_carry_leaves_nothing_and_reruns(
    published: Published, monkeypatch: pytest.MonkeyPatch
) -> None:
    base_b = published.base("b")
    found = published.carry(base_b, REFUSE)

    def dies(self: Registry, row: dict[str, Any]) -> None:
        raise RuntimeError("killed while recording the carry")

    with monkeypatch.context() as m:
        m.setattr(Registry, "record_rebase", dies)
        with pytest.raises(RuntimeError, match="killed"):
            published.publish(base_b, found)
    assert (published.releases / "nimmerworld-base-v2").is_dir()  # renamed, but no row names it
    with pytest.raises(NimmerError, match="no version"):
        published.open("v2")
    db = _db(published.releases)
    assert db.execute("SELECT COUNT(*) FROM lora_rebases").fetchone()[0] == 0
    assert db.execute("SELECT COUNT(*) FROM base_model_versions").fetchone()[0] == 1
    label = published.publish(base_b, found)  # the rerun clears the leftover folder and publishes
    assert label == "nimmerworld-base-v2" and published.open(label).loras == {}
    assert db.execute("SELECT COUNT(*) FROM lora_rebases").fetchone()[0] == len(REGISTERS)


def test_a_pull_of_a_carried_version_brings_exactly_its_signed_loras(
    published: Published, tmp_path: Path
) -> None:
    """A device gets the inherited LoRA and nothing else the mirror holds (the refused one,
    planted extras), and reads the decisions from the signed manifest."""
    label, decided = _split(published)
    inherited = next(d for d in decided.values() if d.decision == "inherited-evaluated")
    mirror = published.releases
    (mirror / "loras" / "zz-extra").mkdir()
    (mirror / "loras" / "zz-extra" / "evil.py").write_text("print('pwned')")
    (mirror / "loras" / inherited.lora_id / "evil.py").write_text("print('pwned')")
    device = tmp_path / "device" / "releases"
    keys = Keyring.load(published.root / "keys" / "trusted")
    got = pull_version(device, str(mirror / label), keys)
    assert got.label == label
    assert sorted(p.name for p in (device / "loras").iterdir()) == [inherited.lora_id]
    assert not (device / "loras" / inherited.lora_id / "evil.py").exists()
    v2 = open_version(device, label, keys)
    assert set(v2.loras) == {inherited.register}
    assert v2.manifest["lora_carry"]["decisions"] == _signed(mirror, label)["lora_carry"]["decisions"]


# --- confirmed defects ---------------------------------------------------------------------------


def test_a_carried_version_can_be_pulled(published: Published, tmp_path: Path) -> None:
    label, _ = _split(published)
    keys = Keyring.load(published.root / "keys" / "trusted")
    device = tmp_path / "device" / "releases"
    assert pull_version(device, str(published.releases / label), keys).label == label


def test_a_lora_planted_in_the_registry_is_not_signed_into_the_next_version(published: Published) -> None:
    releases = published.releases
    genuine = next(p for p in (releases / "loras").iterdir() if p.name.startswith("drunk-scavenger"))
    planted = _variant(genuine, releases / "loras" / f"drunk-scavenger-{'e' * 12}", "e" * 64, 3.0)
    files = [*file_table(planted)]
    files.append(
        {
            "path": MANIFEST,
            "sha256": sha256_file(planted / MANIFEST),
            "size": (planted / MANIFEST).stat().st_size,
        }
    )
    db = _db(releases)
    (weights,) = db.execute(
        "SELECT trained_on_weights_sha256 FROM register_loras WHERE lora_id = ?", (genuine.name,)
    ).fetchone()
    db.execute(
        "INSERT INTO register_loras (lora_id, register, fingerprint, path, files, trained_on_weights_sha256) "
        "VALUES (?, 'drunk-scavenger', ?, ?, ?, ?)",
        (planted.name, "e" * 64, f"loras/{planted.name}", json.dumps(files), weights),
    )
    v1 = _version_id(releases, "v1")
    db.execute(
        "UPDATE lora_compat SET lora_id = ? WHERE lora_id = ? AND version_id = ?",
        (planted.name, genuine.name, v1),
    )
    base_b = published.base("b")
    try:
        found = published.carry(base_b, LENIENT)
        label = published.publish(base_b, found)
    except NimmerError:
        return  # refused: v1's registry rows no longer match its signed manifest
    signed = {c["lora_id"] for c in _signed(releases, label)["compatible_loras"]}
    assert planted.name not in signed, "a LoRA the publisher never signed is now signed as inherited"


def test_a_carry_decided_against_an_older_version_is_not_signed(published: Published) -> None:
    base_b = published.base("b")
    stale = published.carry(base_b, LENIENT)  # decided while v1 is the newest
    base_c = published.base("c", layers=3, seed=2)
    published.publish(base_c, published.carry(base_c, LENIENT))  # another publisher: v2, a major
    try:
        label = published.publish(base_b, stale)
    except NimmerError:
        return  # refused under the lock: the carry is stale
    carried = _signed(published.releases, label)["lora_carry"]
    assert carried["from"] == "nimmerworld-base-v2", f"{label} is signed as carried from {carried['from']}"


def test_a_lora_decided_trained_on_is_listed_by_the_version(published: Published) -> None:
    base_a = published.root / "artifacts" / "base" / "a"
    hivemind = published.root / "adapters" / REGISTERS[0]
    own = _variant(hivemind, published.root / "own" / REGISTERS[0], "d" * 64, 2.0)  # retrained: one register
    found = published.carry(base_a, LENIENT, [own])
    decided = {d.register: d for d in found.decisions}  # the own LoRA supersedes v1's of its register
    assert decided[REGISTERS[0]].decision == "refused" and "superseded" in decided[REGISTERS[0]].reason
    assert decided[REGISTERS[1]].decision == "trained_on"
    version, new = publish_version(
        published.releases, published.key, PublishRequest(base_a, [own], carry=found)
    )
    assert new
    fitting = {
        d["register"]
        for d in _signed(published.releases, version.label)["lora_carry"]["decisions"]
        if d["decision"] != "refused"
    }
    assert fitting == {REGISTERS[1]} and set(published.open(version.label).loras) == set(REGISTERS)


def test_a_version_is_decided_once_the_same_content_under_another_rule_is_the_same_version(
    published: Published,
) -> None:
    """A design choice: a published version is immutable, its carry included. Publishing the same
    content again under a rule that would now inherit returns the existing version, whose signed
    decisions stand (a different outcome needs new content: new weights or new LoRAs)."""
    base_b = published.base("b")
    common = (
        f"paths.artifacts={published.artifacts}",
        f"publish.trusted_keys={published.root / 'keys' / 'trusted'}",
        "publish.rebase.retrain=false",
        "publish.rebase.min_margin=-1e9",
    )
    refusing = config(*common, "publish.rebase.min_gain=1e9")
    req = _carried(refusing, published.releases, PublishRequest(base_b), [])
    first, _ = publish_version(published.releases, published.key, req)
    assert published.open(first.label).loras == {}
    inheriting = config(*common, "publish.rebase.min_gain=-1e9")
    req = _carried(inheriting, published.releases, PublishRequest(base_b), [])
    assert req.carry is None  # already published: nothing is decided again
    version, new = publish_version(published.releases, published.key, req)
    assert (version.label, new) == (first.label, False) and published.open(version.label).loras == {}
    decisions = _signed(published.releases, first.label)["lora_carry"]["decisions"]
    assert {d["decision"] for d in decisions} == {"refused"}


def test_two_loras_of_one_register_are_each_evaluated_or_refused(published: Published) -> None:
    hivemind = published.root / "adapters" / REGISTERS[0]
    other = _variant(hivemind, published.root / "candidate" / REGISTERS[0], "f" * 64, -50.0)
    base_b = published.base("b")
    found = published.carry(base_b, LENIENT, candidates=[other])
    judged = [d for d in found.decisions if d.register == REGISTERS[0] and "cells" in d.evidence]
    cells = [json.dumps(d.evidence["cells"]["own"], sort_keys=True) for d in judged]
    assert len(set(cells)) == len(cells), "two different LoRAs judged by the very same matrix cell"
    refused = next(d for d in found.decisions if d.lora_id.startswith(f"{REGISTERS[0]}-ffff"))
    assert refused.decision == "refused" and "one LoRA per register" in refused.reason
    assert len(found.kept) == len(REGISTERS)  # one per register
