"""Register adapters on disk and in memory: the binding to their base, loading one or all.

An adapter folder is a standard PEFT folder (adapter_config.json, adapter_model.safetensors)
plus ``nimmer_adapter.json``: register, trait profile, the base it was trained on (label and
weights sha256), dataset fingerprints, training-config hash and metrics. Loading onto another
base is refused unless ``allow_other_base`` says otherwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimmer_train.artifacts import read_manifest
from nimmer_train.errors import NimmerError

if TYPE_CHECKING:  # torch, transformers and peft load only when a model does (the CLI stays quick)
    from peft import PeftModel
    from transformers import PreTrainedModel

METADATA = "nimmer_adapter.json"
WEIGHTS = "model.safetensors"


def base_identity(base_dir: Path) -> dict[str, str]:
    """The label and weights sha256 of a published base, from its manifest."""
    manifest = read_manifest(base_dir)
    sha = next((f["sha256"] for f in manifest["files"] if f["path"] == WEIGHTS), None)
    if sha is None:
        raise NimmerError(f"{base_dir} has no {WEIGHTS} in its manifest; is it a published base?")
    return {"label": base_dir.name, "weights_sha256": sha, "fingerprint": manifest["fingerprint"]}


def read_metadata(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / METADATA
    if not path.exists():
        raise NimmerError(f"{adapter_dir} has no {METADATA}; it is not a nimmer register adapter")
    return json.loads(path.read_text())


def check_binding(adapter_dir: Path, base_dir: Path, allow_other_base: bool = False) -> dict[str, Any]:
    """The adapter's metadata, after checking it was trained on this base."""
    meta = read_metadata(adapter_dir)
    base = base_identity(base_dir)
    bound = meta["base"]
    if bound["weights_sha256"] != base["weights_sha256"] and not allow_other_base:
        raise NimmerError(
            f"adapter {adapter_dir.name} ({meta['register']}) was trained on base {bound['label']} "
            f"(weights sha256 {bound['weights_sha256'][:12]}), not on {base['label']} "
            f"(weights sha256 {base['weights_sha256'][:12]}); pass allow_other_base=True to load it anyway"
        )
    return meta


def load_base(base_dir: Path, device: str | None = None) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return AutoModelForCausalLM.from_pretrained(base_dir).to(device)


def load_adapter(base_dir: Path, adapter_dir: Path, allow_other_base: bool = False) -> PeftModel:
    """The base with one register adapter applied, in inference mode."""
    from peft import PeftModel

    meta = check_binding(adapter_dir, base_dir, allow_other_base)
    model = PeftModel.from_pretrained(load_base(base_dir), adapter_dir, adapter_name=meta["register"])
    return model.eval()


def load_all(base_dir: Path, adapter_dirs: list[Path], allow_other_base: bool = False) -> PeftModel:
    """The base with every adapter loaded, named by register; pick one per call with
    ``model.set_adapter(register)`` (and ``with model.disable_adapter():`` for the bare base)."""
    if not adapter_dirs:
        raise NimmerError("no adapters to load")
    from peft import PeftModel

    metas = [check_binding(d, base_dir, allow_other_base) for d in adapter_dirs]
    model = PeftModel.from_pretrained(load_base(base_dir), adapter_dirs[0], adapter_name=metas[0]["register"])
    for folder, meta in zip(adapter_dirs[1:], metas[1:], strict=True):
        model.load_adapter(folder, adapter_name=meta["register"], is_trainable=False)
    return model.eval()
