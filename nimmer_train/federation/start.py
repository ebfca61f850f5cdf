"""The adapter a federation starts from when ``federated.start_rank`` > 0: a fresh small LoRA on
the base instead of a register's adapter. User-level noise is z C / (q N) on every coordinate, so
its norm grows with the adapter's size: at the demo's cohort a register's full LoRA (2.4M
coordinates on SmolLM2) drowns in it, a rank-1 LoRA on two layers' q/v (3,840) does not. Merged
into a version it is the population's change to the base, not a register's voice
(:func:`nimmer_train.artifacts.merged_voice`)."""

from __future__ import annotations

from pathlib import Path

from nimmer_train.artifacts import (
    FRESH_START,
    atomic_dir,
    fingerprint,
    intact_manifest,
    write_json_atomic,
    write_manifest,
)
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.loras.adapters import METADATA, base_identity, load_base


def fresh_start_adapter(base_dir: Path, federated: FederatedConfig, register: str, root: Path) -> Path:
    """A fresh LoRA of ``federated.start_rank`` (seeded A, B = 0, so it starts as the base
    itself) on ``start_targets`` of the base's top ``start_layers`` layers, published once under
    ``root`` (named by the base and the spec). ``register``: whose population's data trains it.
    A client's backward pass stops at the lowest adapted layer."""
    import torch
    from peft import LoraConfig, get_peft_model

    base = base_identity(base_dir)
    spec = {
        "rank": federated.start_rank,
        "layers": federated.start_layers,
        "targets": list(federated.start_targets),
    }
    fp = fingerprint({"base": base, **spec, "seed": federated.seed, "register": register})
    out = root / f"start-{fp[:12]}"
    if intact_manifest(out):
        return out
    model = load_base(base_dir, "cpu")
    layers = int(model.config.num_hidden_layers)
    torch.manual_seed(federated.seed)
    peft = get_peft_model(
        model,
        LoraConfig(
            r=federated.start_rank,
            lora_alpha=2 * federated.start_rank,
            lora_dropout=0.0,
            target_modules=list(federated.start_targets),
            layers_to_transform=list(range(max(layers - federated.start_layers, 0), layers)),
        ),
    )
    meta = {"register": register, "base": base, FRESH_START: spec}
    with atomic_dir(out) as staging:
        peft.save_pretrained(staging)
        (staging / "README.md").unlink(missing_ok=True)
        write_json_atomic(staging / METADATA, meta)
        write_manifest(staging, "register_adapter", fp, {"register": register, "base": base})
    return out
