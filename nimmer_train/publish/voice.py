"""The voice report of a version before it is signed: the weights and register LoRAs a publish
request would publish, loaded through Ring A's :class:`LocalModel` from a private copy of exactly
those bytes, and measured by :func:`nimmer_train.voice.quality.voice_eval`."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimmer_train.artifacts import MANIFEST, README, file_table, intact_manifest, read_manifest
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.publish.registry import REGISTRY_FILE, Registry
from nimmer_train.publish.release import PublishRequest, _stage_model, content_fingerprint

if TYPE_CHECKING:
    from nimmer_train.config import Config
    from nimmer_train.runtime.local_model import LocalModel
    from nimmer_train.voice.quality import VoiceReport

FILE_KEYS = ("path", "sha256", "size")


def already_published(releases: Path, req: PublishRequest) -> bool:
    """True when the registry holds a version with ``req``'s content (publishing returns it as is)."""
    if not (releases / REGISTRY_FILE).exists():
        return False
    registry = Registry.open(releases)
    try:
        return registry.by_fingerprint(content_fingerprint(req)) is not None
    finally:
        registry.close()


@contextlib.contextmanager
def candidate_model(req: PublishRequest) -> Iterator[LocalModel]:
    """Ring A's model of what ``req`` publishes: the base's weights (the adapter merged in, in a
    temporary folder, when it asks for a merge) and its register LoRAs but the merged register's."""
    from nimmer_train.publish.versions import VerifiedVersion
    from nimmer_train.runtime.local_model import LocalModel

    with tempfile.TemporaryDirectory(prefix="nimmer-candidate-") as tmp:
        merged = read_metadata(req.merge_adapter)["register"] if req.merge_adapter else None
        if req.merge_adapter is None:
            folder, rows = req.base_dir, read_manifest(req.base_dir)["files"]
        else:
            folder = Path(tmp) / "model"
            folder.mkdir()
            _stage_model(req, folder)
            rows = file_table(folder)
        files = [{k: f[k] for k in FILE_KEYS} for f in rows if "/" not in f["path"]]
        files = [f for f in files if f["path"] not in (MANIFEST, README)]  # as the version copies them
        loras: dict[str, Path] = {}
        lora_files: dict[str, list[dict[str, Any]]] = {}
        for adapter in req.loras:
            register = read_metadata(adapter)["register"]
            manifest = intact_manifest(adapter)
            if manifest is None:
                raise NimmerError(f"adapter {adapter} is incomplete or changed (its manifest does not match)")
            if register != merged:
                loras[register] = adapter
                lora_files[register] = [{k: f[k] for k in FILE_KEYS} for f in manifest["files"]]
        manifest = {
            "blob_distribution": {"files": files},
            "merged_adapter": {"register": merged} if merged else None,
        }
        model = LocalModel(VerifiedVersion("candidate", folder, manifest, loras, lora_files))
        try:
            yield model
        finally:
            model.close()


def voice_report(cfg: Config, req: PublishRequest) -> VoiceReport:
    """The voice report of what ``req`` publishes (cfg.publish.voice_eval's set of turns) on the
    scenes held out of its adapters' training sets (the current config's when not found); the
    report's settings record them, so the speak stage measures on the same ones."""
    from nimmer_train.voice.quality import heldout_of_adapters, heldout_of_config, voice_eval

    adapters = [*req.loras, *([req.merge_adapter] if req.merge_adapter else [])]
    heldout = heldout_of_adapters(adapters, cfg.paths.artifacts_dir()) or heldout_of_config(
        cfg.composition, cfg.curation.validation_fraction
    )
    with candidate_model(req) as model:
        return voice_eval(
            model, cfg.publish.voice_eval, cfg.registers, cfg.composition, heldout, req.evaluation
        )
