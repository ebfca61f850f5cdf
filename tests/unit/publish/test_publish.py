"""Publishing versions: the manifest and model card, the registry, the MLflow Model Registry,
verified loading, tampering, foreign keys, LoRA compatibility. The publish pipeline killed midway
is in tests/e2e/test_publish_pipeline.py."""

from __future__ import annotations

import json
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from nimmer_train import cli
from nimmer_train.artifacts import write_json_atomic, write_manifest
from nimmer_train.errors import NimmerError
from nimmer_train.federation.client import device_examples
from nimmer_train.loras.adapters import METADATA
from nimmer_train.publish.manifest import SIGNATURE, IntegrityError, manifest_bytes
from nimmer_train.publish.registry import Registry
from nimmer_train.publish.release import PublishRequest, publish_version
from nimmer_train.publish.signing import (
    Keyring,
    SignatureError,
    generate_key,
    load_private,
    sign,
    signature_bytes,
)
from nimmer_train.publish.versions import CompatibilityError, check_lora, load_model, open_version
from tests.helpers.outputs import base_dir as _base
from tests.helpers.outputs import keyring as _keyring

pytestmark = pytest.mark.slow

ROW_FIELDS = {
    "version_id",
    "version_label",
    "base_model_origin",
    "training_corpus_refs",
    "training_recipe_ref",
    "released_at",
    "differential_privacy_epsilon",
    "contributors_count",
    "blob_distribution",
}


def _federated(workdir: Path) -> Path:
    (adapter,) = (workdir / "artifacts" / "federated").glob("*/*")
    return adapter


def test_run_all_publishes_v1_and_the_federated_v2(tiny_run: Path) -> None:
    releases = tiny_run / "releases"
    v1 = open_version(releases, "v1", _keyring(tiny_run))
    v2 = open_version(releases, "candidate", _keyring(tiny_run))
    assert (v1.label, v2.label) == ("nimmerworld-base-v1", "nimmerworld-base-v2")
    for version in (v1, v2):
        assert set(version.manifest) >= ROW_FIELDS
        assert {f["path"] for f in version.manifest["blob_distribution"]["files"]} >= {
            "model.safetensors",
            "tokenizer.json",
            "config.json",
            "README.md",
        }
        recipe = version.manifest["training_recipe_ref"]
        assert recipe["git_commit"] and recipe["publish_config"]["model"]["name"] == "tiny"
        assert (
            recipe["dataset_fingerprints"]["literary"]
            == version.manifest["training_corpus_refs"]["literary"]["fingerprint"]
        )
    # v1: the base as built, no player data; its LoRAs were trained on exactly these weights
    assert v1.manifest["differential_privacy_epsilon"] is None and v1.manifest["contributors_count"] == 0
    assert {c["relation"] for c in v1.manifest["compatible_loras"]} == {"trained_on"}
    assert set(v1.loras) == {"hivemind-broadcast", "drunk-scavenger"}
    # v2: the federated adapter merged in; figures from the federation's round records
    fed = json.loads((_federated(tiny_run) / METADATA).read_text())["federation"]
    m2 = v2.manifest
    assert m2["parent_version"] == v1.label and m2["merged_adapter"]["federation"] == fed["fingerprint"]
    assert m2["differential_privacy_epsilon"] == pytest.approx(fed["epsilon_a2_record_level"])
    # counts from a federation are noised estimates (issue 20): 3 A.1 contributors at z = 0.01
    # round to 3; the A.2 uploads carry noise of std 5 * sqrt(2)
    assert fed["counts_noised"] and m2["privacy"]["counts_noised"] and fed["contributors_a1"] == 3
    assert m2["contributors_count"] == fed["contributors_a1"] + fed["uploads_a2"]
    tiers = m2["training_corpus_refs"]["player_contributed"]
    assert tiers["counts_noised"] and "No exact count" in tiers["noised_figures"]
    assert (
        tiers["A1_federated"]["contributors"] == 3 and tiers["A2_anonymized"]["uploads"] == fed["uploads_a2"]
    )
    assert "examples_per_round" not in json.dumps(m2)  # no exact count of anyone's data
    assert tiers["A1_federated"]["epsilon"] == pytest.approx(fed["epsilon_a1_user_level"])
    assert m2["privacy"]["mechanisms"] == fed["mechanisms"]
    assert m2["weights_sha256"] != v1.manifest["weights_sha256"]
    # v1's LoRAs were decided on v2's weights before v2 was signed: hivemind-broadcast's voice is
    # merged into them; drunk-scavenger's LoRA is inherited if it passes the rule there, else retrained
    carried = {d["register"]: d for d in m2["lora_carry"]["decisions"]}
    assert (
        carried["hivemind-broadcast"]["decision"] == "refused"
        and "merged" in carried["hivemind-broadcast"]["reason"]
    )
    scavenger = carried["drunk-scavenger"]
    assert scavenger["decision"] in ("inherited-evaluated", "rebased") and "gain" in scavenger["reason"]
    assert set(v2.loras) == {"drunk-scavenger"}
    trained_on = json.loads((v2.loras["drunk-scavenger"] / METADATA).read_text())["base"]["weights_sha256"]
    fits_v2 = {"inherited-evaluated": v1.manifest["weights_sha256"], "rebased": m2["weights_sha256"]}
    assert trained_on == fits_v2[scavenger["decision"]]
    # the model card: Hugging Face front matter and a privacy section with aggregates only
    card = (v2.folder / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["license"] == "apache-2.0" and front["base_model"] == v1.label and front["datasets"]
    privacy = card.split("\n## Privacy\n")[1]
    assert (
        "Delta: 1e-05" in privacy
        and f"{fed['epsilon_a2_record_level']:.3f}" in privacy
        and "3 contributors (noised estimate)" in privacy
    )
    # each epsilon says exactly which mechanism it covers
    assert privacy.count("  - covers: ") == 2
    # the voice report (experiment ci_tiny: 3 turns per register) of each version's registers:
    # v1's two LoRAs; v2's LoRA and the register merged into its weights
    for version in (v1, v2):
        voice = version.manifest["voice_report"]
        assert voice["version"] == version.label and voice["overall"]["turns"] == 6
        assert [r["register"] for r in voice["registers"]] == ["drunk-scavenger", "hivemind-broadcast"]
    assert "## Voice report" in card and "**The bar**" in card
    assert "Gaussian mechanism on the sum" in privacy and "DP-SGD on the anonymised pool" in privacy
    assert "noised pool counts" in privacy and "Local DP-SGD on A.1 devices" in privacy
    # the server never learns who contributed: no id reaches the card, the manifest or the registry,
    # and the uploads table gets no per-contributor rows from a federation
    devices = tiny_run / "federation" / fed["fingerprint"][:12] / "devices"
    contributor_ids = [c for d in sorted(devices.glob("device-*")) if (c := device_examples(d)[1])]
    assert len(contributor_ids) == 3
    registry_bytes = (releases / "registry.sqlite").read_bytes()
    for text in (card, (v2.folder / "manifest.json").read_text(), registry_bytes.decode("latin-1")):
        assert not any(c in text for c in contributor_ids)
    db = sqlite3.connect(releases / "registry.sqlite")
    assert db.execute("SELECT COUNT(*) FROM federated_gradient_uploads").fetchone() == (0,)
    # both load and generate; the merge changed the outputs
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        model1, model2 = load_model(v1), load_model(v2)
        model1.set_adapter("drunk-scavenger")
        assert torch.isfinite(model1(input_ids=ids).logits).all()
        with model1.disable_adapter():
            bare1 = model1(input_ids=ids).logits
        with model2.disable_adapter():
            bare2 = model2(input_ids=ids).logits
    assert not torch.allclose(bare1, bare2)
    # publishing the same inputs again is a no-op
    loras = [releases / c["path"] for c in v1.manifest["compatible_loras"]]
    again, new = publish_version(
        releases, tiny_run / "keys" / "publisher.key", PublishRequest(_base(tiny_run), loras)
    )
    assert (again.label, new) == ("nimmerworld-base-v1", False)


def test_mlflow_model_registry_and_promote(tiny_run: Path, capsys: pytest.CaptureFixture[str]) -> None:
    client = MlflowClient(f"sqlite:///{tiny_run / 'mlflow.db'}")
    versions = {
        mv.tags["version_label"]: mv for mv in client.search_model_versions("name='nimmerworld-base'")
    }
    assert set(versions) >= {"nimmerworld-base-v1", "nimmerworld-base-v2"}
    v2 = versions["nimmerworld-base-v2"]
    manifest = open_version(tiny_run / "releases", "v2", _keyring(tiny_run)).manifest
    labelled = {"epsilon_a1_user_level", "epsilon_a2_record_level", "dp_delta", "contributors_count"}
    assert labelled <= set(v2.tags) and "epsilon" not in v2.tags  # both levels by name (issue 42)
    literary = manifest["training_corpus_refs"]["literary"]
    assert (
        v2.tags["contributors_count"] == str(manifest["contributors_count"])  # a noised estimate
        and v2.tags[f"corpus.{literary['name']}"] == literary["fingerprint"]
    )
    assert client.get_model_version_by_alias("nimmerworld-base", "candidate").version == v2.version
    first = client.get_model_version_by_alias("nimmerworld-base", "production")  # publish.promote_first
    assert first.tags["version_label"] == "nimmerworld-base-v1"
    lora = client.get_registered_model("nimmerworld-lora-drunk-scavenger")
    fits = sorted(mv.tags["fits"] for mv in client.search_model_versions(f"name='{lora.name}'"))
    carried = {d["register"]: d["decision"] for d in manifest["lora_carry"]["decisions"]}
    both = "nimmerworld-base-v1,nimmerworld-base-v2"  # inherited: one LoRA fits both; else one each
    assert fits == (
        [both] if carried["drunk-scavenger"] == "inherited-evaluated" else sorted(both.split(","))
    )
    releases = str(tiny_run / "releases")
    assert cli.main(["versions", "--releases", releases, "promote", "v1"]) == 0
    assert (
        client.get_model_version_by_alias("nimmerworld-base", "production").tags["version_label"]
        == "nimmerworld-base-v1"
    )
    assert cli.main(["versions", "--releases", releases, "list"]) == 0
    out = capsys.readouterr().out
    assert "nimmerworld-base-v1" in out and "production" in out and "candidate" in out
    assert "eps A.1 user-level" in out and "eps A.2 record-level" in out  # both guarantees, labelled
    privacy = manifest["privacy"]
    v2_line = next(line for line in out.splitlines() if line.startswith("nimmerworld-base-v2"))
    assert f"{privacy['epsilon_a1_user_level']:.3f}" in v2_line
    assert f"{privacy['epsilon_a2_record_level']:.3f}" in v2_line
    assert cli.main(["versions", "--releases", releases, "verify", "production"]) == 0
    assert "signature OK" in capsys.readouterr().out
    assert cli.main(["versions", "--releases", releases, "show", "v2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["federated_gradient_uploads"] == 0 and shown["aliases"] == ["candidate"]  # no ids, no rows
    assert cli.main(["versions", "--releases", releases, "show", "v9"]) == 1
    assert "no version 'v9'" in capsys.readouterr().err


def _flip(path: Path, at: int | None = None) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2 if at is None else at] ^= 0x01
    path.write_bytes(bytes(data))


def test_tampering_and_foreign_keys_fail_naming_the_file_or_key(tiny_run: Path, tmp_path: Path) -> None:
    releases = tmp_path / "releases"
    shutil.copytree(tiny_run / "releases", releases)
    shutil.copytree(tiny_run / "keys", tmp_path / "keys")
    keyring = _keyring(tmp_path)
    folder = releases / "nimmerworld-base-v1"
    pristine = tmp_path / "pristine"
    shutil.copytree(folder, pristine)

    def fails(expected: type[Exception], *words: str) -> None:
        with pytest.raises(expected) as info:
            open_version(releases, "v1", keyring)
        for word in words:
            assert word in str(info.value), str(info.value)
        shutil.rmtree(folder)
        shutil.copytree(pristine, folder)

    open_version(releases, "v1", keyring)
    for name in ("model.safetensors", "tokenizer.json", "README.md"):
        _flip(folder / name)
        fails(IntegrityError, name, "sha256")
    _flip(folder / "model.safetensors", at=0)  # the safetensors header
    fails(IntegrityError, "model.safetensors")
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.truncate(1000)
    fails(IntegrityError, "model.safetensors", "truncated")
    (folder / "tokenizer_config.json").unlink()
    fails(IntegrityError, "tokenizer_config.json", "missing")
    (folder / "extra.bin").write_bytes(b"x")
    fails(IntegrityError, "extra.bin")
    _flip(folder / "manifest.json")
    fails(SignatureError, "manifest", "does not verify")
    (folder / SIGNATURE).unlink()
    fails(IntegrityError, SIGNATURE, "missing")
    # a changed manifest re-signed by a stranger
    stranger = tmp_path / "stranger.key"
    stranger_id = generate_key(stranger)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["contributors_count"] = 0
    raw = manifest_bytes(manifest)
    (folder / "manifest.json").write_bytes(raw)
    (folder / SIGNATURE).write_bytes(signature_bytes(sign(raw, load_private(stranger))))
    fails(SignatureError, stranger_id, "not a trusted publisher key")
    # a flipped byte in a LoRA that fits v1
    manifest = json.loads((releases / "nimmerworld-base-v1" / "manifest.json").read_text())
    (path,) = [c["path"] for c in manifest["compatible_loras"] if c["register"] == "drunk-scavenger"]
    _flip(releases / path / "adapter_model.safetensors")
    with pytest.raises(IntegrityError, match="adapter_model.safetensors"):
        open_version(releases, "v1", keyring)


def test_key_rotation(tiny_run: Path, tmp_path: Path) -> None:
    """A new key signs new versions; old ones load while the old key is trusted, and fail naming it
    once it is removed."""
    shutil.copytree(tiny_run / "keys", tmp_path / "keys")
    releases = tmp_path / "releases"
    shutil.copytree(tiny_run / "releases", releases)
    trusted = tmp_path / "keys" / "trusted"
    new_key = tmp_path / "keys" / "publisher-2.key"
    new_id = generate_key(new_key, trusted)
    version, new = publish_version(
        releases, new_key, PublishRequest(_base(tiny_run), blob_base_url="https://cdn.example/bases")
    )
    assert new and version.label == "nimmerworld-base-v3" and version.row["signing_key_id"] == new_id
    assert version.row["blob_distribution"]["files"][0]["location"].startswith(
        "https://cdn.example/bases/nimmerworld-base-v3/"
    )
    open_version(releases, "v1", Keyring.load(trusted))
    registry = Registry.open(releases)
    old_id = registry.find("v1").row["signing_key_id"]
    registry.close()
    (trusted / f"{old_id}.pub").unlink()
    open_version(releases, "v3", Keyring.load(trusted))
    with pytest.raises(SignatureError, match=old_id):
        open_version(releases, "v1", Keyring.load(trusted))


def test_lora_compatibility_is_checked_against_the_registry(tiny_run: Path, tmp_path: Path) -> None:
    releases = tiny_run / "releases"
    hivemind = next((releases / "loras").glob("hivemind-broadcast-*"))
    assert check_lora(releases, "v1", hivemind)["register"] == "hivemind-broadcast"
    with pytest.raises(CompatibilityError, match="fits nimmerworld-base-v1, not nimmerworld-base-v2"):
        check_lora(releases, "v2", hivemind)
    # a LoRA trained on another base: not in the registry, and refused by publish
    other = tmp_path / "other-lora"
    shutil.copytree(hivemind, other)
    meta = json.loads((other / METADATA).read_text())
    meta["base"] = {**meta["base"], "label": "tiny-elsewhere", "weights_sha256": "0" * 64}
    write_json_atomic(other / METADATA, meta)
    write_manifest(other, "register_adapter", "f" * 64, {"register": meta["register"], "base": meta["base"]})
    with pytest.raises(CompatibilityError, match="not in the registry.*tiny-elsewhere"):
        check_lora(releases, "v1", other)
    scratch = tmp_path / "releases"
    with pytest.raises(NimmerError, match="trained on other base weights"):
        publish_version(
            scratch, tiny_run / "keys" / "publisher.key", PublishRequest(_base(tiny_run), [other])
        )
    assert Registry.open(scratch).versions() == []
