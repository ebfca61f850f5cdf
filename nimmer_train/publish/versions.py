"""Loading a published version the way a player's runtime does: by label or alias, verified
(signature, then every file's sha256), with the register LoRAs that fit it.

Nothing unsigned is trusted: the registry row must name the version's own folder and the signed
manifest's label and id; each LoRA the registry says fits must be listed, with its path and file
hashes, in the signed manifest (the registry's LoRAs are a subset of the manifest's), inside
releases/loras/. Symlinks are refused. Loading copies each file once into a private folder, hashing
the bytes as they are copied, and loads from that copy: the bytes loaded are the bytes verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nimmer_train.artifacts import MANIFEST, read_manifest
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.publish.manifest import IntegrityError, check_files, safe_relative, verify_folder
from nimmer_train.publish.registry import Registry, Version, label_of
from nimmer_train.publish.signing import Keyring


class CompatibilityError(NimmerError):
    """A LoRA that the registry does not list as fitting the version it is loaded onto."""


@dataclass(frozen=True)
class VerifiedVersion:
    label: str
    folder: Path
    manifest: dict[str, Any]
    loras: dict[str, Path]  # register -> verified adapter folder that fits this version
    lora_files: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # register -> signed files


def _check_row(registry: Registry, version: Version) -> None:
    """The registry row names its own folder: ``nimmerworld-base-vN`` for its number, no path."""
    label, number = version.label, version.row["version_number"]
    if label != label_of(number) or version.folder != registry.releases / label:
        raise IntegrityError(
            f"registry row {number} has label {label!r}, not {label_of(number)}: the registry was "
            "edited; refusing to open another folder than the version's own"
        )


def _signed_loras(registry: Registry, version: Version, manifest: dict[str, Any]) -> dict[str, Any]:
    """register -> (folder, files) for each LoRA the registry says fits ``version``, each of which
    the signed manifest must list with the same path; files are the manifest's, never the
    registry's (the registry is not signed)."""
    signed = {c.get("lora_id"): c for c in manifest.get("compatible_loras", []) if isinstance(c, dict)}
    loras: dict[str, Any] = {}
    for row in registry.loras_for(version):
        entry = signed.get(row["lora_id"])
        what = f"LoRA {row['lora_id']}"
        if entry is None:
            raise IntegrityError(
                f"{version.label}: the registry lists {what} as fitting, but the signed manifest does not; "
                "the registry was edited or the LoRA belongs to another version"
            )
        if "files" not in entry or "path" not in entry:
            raise IntegrityError(
                f"{version.label}: the signed manifest does not list {what}'s file hashes (published "
                "before they were signed); publish the version again to load its LoRAs"
            )
        rel = safe_relative(entry["path"], what)
        if (rel, entry["register"]) != (row["path"], row["register"]) or not rel.startswith("loras/"):
            raise IntegrityError(
                f"{version.label}: the registry puts {what} at {row['path']!r}, the signed manifest at "
                f"{rel!r}; refusing a LoRA outside the signed releases/loras/ folder"
            )
        folder = registry.releases / rel
        check_files(folder, entry["files"], what)
        loras[entry["register"]] = (folder, entry["files"])
    return loras


def verify_version(registry: Registry, version: Version, keyring: Keyring) -> VerifiedVersion:
    _check_row(registry, version)
    manifest = verify_folder(version.folder, keyring)
    digest = hashlib.sha256((version.folder / MANIFEST).read_bytes()).hexdigest()
    if digest != version.row["manifest_sha256"]:
        raise IntegrityError(
            f"{version.label}: manifest.json is validly signed but is not the one the registry "
            f"recorded at publish (sha256 {digest[:12]} vs {version.row['manifest_sha256'][:12]})"
        )
    for key, row_key in (("version_label", "version_label"), ("version_id", "version_id")):
        if manifest.get(key) != version.row[row_key]:
            raise IntegrityError(
                f"{version.label}: the signed manifest's {key} is {manifest.get(key)!r}, the registry "
                f"row's {version.row[row_key]!r}; this folder holds another version"
            )
    loras = _signed_loras(registry, version, manifest)
    return VerifiedVersion(
        version.label,
        version.folder,
        manifest,
        {r: folder for r, (folder, _) in loras.items()},
        {r: files for r, (_, files) in loras.items()},
    )


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


def _copy_verified(src: Path, files: list[dict[str, Any]], dst: Path, what: str) -> Path:
    """Copy each listed file of ``src`` into ``dst``, hashing the very bytes written (read once,
    never through a symlink, a regular file only, never more than one byte past its signed size);
    IntegrityError if any differs from its signed sha256 or size."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)  # a FIFO never blocks
    for row in files:
        rel = safe_relative(row["path"], what)
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        try:
            fd = os.open(src / rel, flags)
        except OSError as exc:
            raise IntegrityError(f"{what}: file {rel} cannot be opened in {src} ({exc})") from exc
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise IntegrityError(f"{what}: {rel} in {src} is not a regular file; refused")
        left = int(row["size"]) + 1  # one byte more tells a grown file; a huge one is never copied
        with os.fdopen(fd, "rb") as fh, open(target, "wb") as out:
            while left > 0 and (chunk := fh.read(min(1 << 20, left))):
                digest.update(chunk)
                size += len(chunk)
                left -= len(chunk)
                out.write(chunk)
        if (digest.hexdigest(), size) != (row["sha256"], row["size"]):
            raise IntegrityError(
                f"{what}: file {rel} changed after verification (sha256 {digest.hexdigest()[:12]}, "
                f"signed {row['sha256'][:12]}); nothing was loaded"
            )
    return dst


@contextlib.contextmanager
def verified_copy(version: VerifiedVersion) -> Iterator[VerifiedVersion]:
    """The version with its folder and LoRAs replaced by a private copy (a 0700 temporary folder,
    removed on exit) whose bytes were hashed as they were copied: what is loaded from it is what
    was verified, whatever happens to the release folder meanwhile."""
    with tempfile.TemporaryDirectory(prefix="nimmer-verified-") as tmp:
        root = Path(tmp)
        files = version.manifest["blob_distribution"]["files"]  # the GGUF files: quantized_model's
        files = [f for f in files if not str(f.get("path", "")).startswith("quantized/")]
        folder = _copy_verified(version.folder, files, root / "version", version.label)
        loras = {
            register: _copy_verified(version.loras[register], files, root / "loras" / register, register)
            for register, files in version.lora_files.items()
        }
        yield dataclasses.replace(version, folder=folder, loras=loras)


def load_verified(
    version: VerifiedVersion, registers: list[str] | None = None, device: str = "cpu"
) -> tuple[Any, Any]:
    """The model (as :func:`load_model`) and its tokenizer, both loaded from one private copy whose
    bytes were hashed as they were read."""
    from transformers import AutoTokenizer

    with verified_copy(version) as copy:
        return _load(copy, registers, device), AutoTokenizer.from_pretrained(copy.folder)


def load_model(version: VerifiedVersion, registers: list[str] | None = None, device: str = "cpu") -> Any:
    """The version's model with its fitting LoRAs loaded by register name (``set_adapter`` picks
    one per call); the bare model when none fit. Loaded from a private copy whose bytes were
    hashed as they were read (:func:`verified_copy`)."""
    with verified_copy(version) as copy:
        return _load(copy, registers, device)


def _load(version: VerifiedVersion, registers: list[str] | None, device: str) -> Any:
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
