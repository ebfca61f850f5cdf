"""Loading a published version the way a player's runtime does: by label or alias, verified
(signature, then every file's sha256), with the register LoRAs the registry says fit it."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import MANIFEST, read_manifest
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.publish.manifest import IntegrityError, check_files, verify_folder
from nimmer_train.publish.registry import Registry, Version
from nimmer_train.publish.signing import Keyring


class CompatibilityError(NimmerError):
    """A LoRA that the registry does not list as fitting the version it is loaded onto."""


@dataclass(frozen=True)
class VerifiedVersion:
    label: str
    folder: Path
    manifest: dict[str, Any]
    loras: dict[str, Path]  # register -> verified adapter folder that fits this version


def verify_version(registry: Registry, version: Version, keyring: Keyring) -> VerifiedVersion:
    manifest = verify_folder(version.folder, keyring)
    digest = hashlib.sha256((version.folder / MANIFEST).read_bytes()).hexdigest()
    if digest != version.row["manifest_sha256"]:
        raise IntegrityError(
            f"{version.label}: manifest.json is validly signed but is not the one the registry "
            f"recorded at publish (sha256 {digest[:12]} vs {version.row['manifest_sha256'][:12]})"
        )
    loras = {}
    for row in registry.loras_for(version):
        folder = registry.releases / row["path"]
        check_files(folder, row["files"], f"LoRA {row['lora_id']}")
        loras[row["register"]] = folder
    return VerifiedVersion(version.label, version.folder, manifest, loras)


def open_version(releases: Path, name: str, keyring: Keyring) -> VerifiedVersion:
    """Find ``name`` (vN, nimmerworld-base-vN, candidate, production) and verify it."""
    registry = Registry.open(releases)
    try:
        return verify_version(registry, registry.find(name), keyring)
    finally:
        registry.close()


def check_lora(releases: Path, version_name: str, adapter_dir: Path) -> dict[str, Any]:
    """The adapter's metadata once the registry confirms it fits the version and its files match."""
    manifest = read_manifest(adapter_dir)
    meta = read_metadata(adapter_dir)
    lora_id = f"{meta['register']}-{manifest['fingerprint'][:12]}"
    registry = Registry.open(releases)
    try:
        version = registry.find(version_name)
        row = registry.lora(lora_id)
        if row is None:
            raise CompatibilityError(
                f"LoRA {lora_id} ({adapter_dir}) is not in the registry, so nothing says it fits "
                f"{version.label}; it was trained on base {meta['base']['label']}"
            )
        fits = registry.fits(lora_id)
        if version.label not in fits:
            raise CompatibilityError(
                f"LoRA {lora_id} fits {', '.join(fits) or 'no version'}, not {version.label}; "
                "load it onto a version it fits or train one for this base"
            )
        check_files(adapter_dir, row["files"], f"LoRA {lora_id}")
    finally:
        registry.close()
    return meta


def load_model(version: VerifiedVersion, registers: list[str] | None = None, device: str = "cpu") -> Any:
    """The version's model with its fitting LoRAs loaded by register name (``set_adapter`` picks
    one per call); the bare model when none fit."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(version.folder).to(device)
    wanted = [r for r in (registers or list(version.loras)) if r in version.loras]
    missing = sorted(set(registers or []) - set(version.loras))
    if missing:
        raise CompatibilityError(
            f"no LoRA fits {version.label} for register(s) {', '.join(missing)}; "
            f"fitting: {', '.join(version.loras) or 'none'}"
        )
    if not wanted:
        return model.eval()
    peft = PeftModel.from_pretrained(model, version.loras[wanted[0]], adapter_name=wanted[0])
    for register in wanted[1:]:
        peft.load_adapter(version.loras[register], adapter_name=register, is_trainable=False)
    return peft.eval()
