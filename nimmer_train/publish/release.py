"""Publish a built base (optionally with an adapter merged into its weights) as
``nimmerworld-base-vN``: weights, tokenizer, config, model card, signed manifest, registry rows.

Atomic: under the registry's write lock the version is staged in a hidden folder, fsynced,
renamed to its label, and its rows commit last; a publisher killed anywhere leaves no visible
version and no row (the next publish clears what it left). Publishing the same inputs again
returns the existing version.

Crash drill: ``NIMMER_PUBLISH_DRILL=staged|renamed`` SIGKILLs the process after staging or after
the rename (just before the commit), for tests that prove the above.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import signal
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimmer_train.artifacts import (
    FRESH_START,
    MANIFEST,
    README,
    atomic_dir,
    fingerprint,
    intact_manifest,
    merged_path,
    merged_voice,
    read_manifest,
    sha256_file,
    write_manifest,
)
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import WEIGHTS, base_identity, read_metadata
from nimmer_train.publish import card
from nimmer_train.publish.listing import A1, A2, privacy_caveats
from nimmer_train.publish.manifest import FORMAT, SIGNATURE, manifest_bytes, release_files
from nimmer_train.publish.quantize import QUANTIZED, stage_quantized
from nimmer_train.publish.registry import REGISTRY_FILE, Registry, Version, label_of
from nimmer_train.publish.signing import load_private, sign, signature_bytes

if TYPE_CHECKING:
    from nimmer_train.publish.rebase import Carry

log = logging.getLogger(__name__)
DRILL = "NIMMER_PUBLISH_DRILL"
# base-folder files that are not part of the model itself
NOT_COPIED = {MANIFEST, README}


@dataclass(frozen=True)
class PublishRequest:
    """What goes into one version."""

    base_dir: Path  # a built base folder (artifacts/base/<name>)
    loras: list[Path] = field(default_factory=list)  # register adapters that fit it
    merge_adapter: Path | None = None  # a federated / A.2 adapter to merge into the weights
    recipe: dict[str, Any] = field(default_factory=dict)  # resolved config of the publishing job
    license: str = "apache-2.0"
    blob_base_url: str | None = None  # where players download from; None: file:// of the releases
    evaluation: dict[str, Any] | None = None  # the register LoRAs' evaluation (loras/evaluation.py)
    voice: dict[str, Any] | None = None  # the voice report of this content (voice/quality.py)
    merged_dir: Path | None = None  # the merge already staged (publish/stage.py): copied, not redone
    carry: Carry | None = None  # the previous version's LoRAs, decided on these weights (rebase.py)
    quantized: tuple[str, ...] = QUANTIZED  # GGUF bases for Ring A's quantized engine (quantize.py)

    def adapters(self) -> list[Path]:
        """Every register LoRA the version will list: its own, the retrained and the inherited."""
        carried = [*self.carry.rebased, *self.carry.kept] if self.carry else []
        return [*self.loras, *carried]


def _drill(point: str) -> None:
    if os.environ.get(DRILL) == point:
        log.warning("publish drill: SIGKILL at %s", point)
        os.kill(os.getpid(), signal.SIGKILL)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def content_fingerprint(req: PublishRequest) -> str:
    return fingerprint(
        {
            "format": FORMAT,
            "base": read_manifest(req.base_dir)["fingerprint"],
            "merge": read_manifest(req.merge_adapter)["fingerprint"] if req.merge_adapter else None,
            "loras": sorted(read_manifest(p)["fingerprint"] for p in req.loras),
        }
    )


def already_published(releases: Path, req: PublishRequest) -> bool:
    """True when the registry holds a version with ``req``'s content (publishing returns it as is)."""
    if not (releases / REGISTRY_FILE).exists():
        return False
    registry = Registry.open(releases)
    try:
        return registry.by_fingerprint(content_fingerprint(req)) is not None
    finally:
        registry.close()


def _merged_synth(merged_meta: dict[str, Any] | None) -> str | None:
    """The fingerprint of the synthetic set the merged adapter was trained on (a register's
    adapter); None for no merge or a fresh adapter the population trained (``fresh_start``)."""
    return ((merged_meta or {}).get("datasets") or {}).get("synth")


def _corpus_refs(req: PublishRequest, base_manifest: dict[str, Any], merged: dict[str, Any] | None) -> dict:
    from nimmer_train.memory.consent import NEVER_SHARED

    lineage = base_manifest["lineage"]
    literary: dict[str, Any] = {"fingerprint": lineage["dataset_fingerprint"], "license": "public-domain"}
    corpus_dir = Path(lineage["dataset_dir"]).parent
    if (corpus_dir / MANIFEST).exists():
        corpus = read_manifest(corpus_dir)
        stats = corpus["lineage"].get("stats", {})
        literary.update(
            name=corpus["lineage"].get("corpus", corpus_dir.name.rsplit("-", 1)[0]),
            works=len(corpus["lineage"].get("sources", {})),
            tokens=sum(w.get("train_tokens", 0) for w in stats.get("per_work", {}).values()),
            token_unit=stats.get("token_unit", "unknown"),
            sources=corpus["lineage"].get("sources", {}),
        )
    else:
        literary["name"] = corpus_dir.name.rsplit("-", 1)[0]
    fed = (merged or {}).get("federation", {})
    contributed: dict[str, Any] = {}
    if req.merge_adapter:
        from nimmer_train.federation.results import CONTRIBUTED

        if (req.merge_adapter / CONTRIBUTED).exists():
            contributed = json.loads((req.merge_adapter / CONTRIBUTED).read_text())
    tiers = contributed.get("tiers", {})
    caveats = privacy_caveats(fed) if fed else {}
    return {
        "literary": literary,
        # the base's own mix (issue 25), else the synthetic set the merged adapter was trained on
        # (a fresh adapter the population trained has none: only player_contributed below)
        "synthetic": lineage.get("training_corpus_refs", {}).get("synthetic")
        or ({"fingerprint": synth} if (synth := _merged_synth(merged)) else None),
        "player_contributed": {
            "opt_out": {"used": False},
            # counts from a federation are noised estimates (issue 20): never an exact count
            "A1_federated": {
                "contributors": fed.get("contributors_a1", 0),
                "guarantee": _guarantee(
                    tiers.get("A1_federated", {}).get("guarantee", "user-level"), caveats.get(A1)
                ),
                "contributions_per_round_noised": tiers.get("A1_federated", {}).get(
                    "contributions_per_round_noised", []
                ),
                "epsilon": fed.get("epsilon_a1_user_level"),
                "caveat": caveats.get(A1),  # the epsilon bounds nothing (results.caveat)
            },
            "A2_anonymized": {
                "uploads": fed.get("uploads_a2", 0),
                "guarantee": _guarantee(
                    tiers.get("A2_anonymized", {}).get("guarantee", "record-level"), caveats.get(A2)
                ),
                "data_categories_noised": tiers.get("A2_anonymized", {}).get("data_categories_noised"),
                "epsilon": fed.get("epsilon_a2_record_level"),
                "caveat": caveats.get(A2),
            },
            "counts_noised": bool(fed.get("counts_noised")),
            "noised_figures": contributed.get("noised_figures"),
            "A3_pseudonymous_full": {"contributors": 0, "note": "not in scope for training yet"},
            "never_shared": sorted(NEVER_SHARED),
            "federation": fed.get("fingerprint"),
        },
    }


def _origin(base_manifest: dict[str, Any]) -> str:
    model, origin = base_manifest["lineage"]["model"], base_manifest["lineage"].get("origin") or {}
    if origin.get("checkpoint"):  # a pretrained checkpoint (e.g. SmolLM2 from its GGUF), not its local copy
        licence = f", {origin['license']}" if origin.get("license") else ""
        return f"{origin['checkpoint']} (continued pretraining on the literary corpus{licence})"
    if model.get("name_or_path"):
        return str(model["name_or_path"])
    params = base_manifest["lineage"]["metrics"].get("parameters")
    return (
        f"scratch:{model.get('family', 'llama')}-{model['name']} ({params} parameters, no pretrained weights)"
    )


def _stage_model(req: PublishRequest, staging: Path) -> None:
    """Weights, config and tokenizer into ``staging``; the adapter merged in when asked."""
    if req.merge_adapter is None or req.merged_dir is not None:
        for item in (req.merged_dir or req.base_dir).iterdir():
            if item.name not in NOT_COPIED and item.is_file():
                shutil.copy2(item, staging / item.name)
        return
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(req.base_dir, dtype="float32")
    merged = PeftModel.from_pretrained(model, req.merge_adapter).merge_and_unload()
    merged.save_pretrained(staging)
    for item in req.base_dir.iterdir():  # tokenizer and templates, unchanged by the merge
        if item.is_file() and item.name not in NOT_COPIED and not (staging / item.name).exists():
            shutil.copy2(item, staging / item.name)


def stage_merge(req: PublishRequest, artifacts: Path) -> Path:
    """``req``'s base with its adapter merged in, as an artifacts folder that training and
    evaluation can read (``artifacts/merged/<base>-<fp>``; an intact one is reused), so that the
    carrying decisions and the version are made from the same weights."""
    assert req.merge_adapter is not None
    lineage = {
        "base": read_manifest(req.base_dir)["fingerprint"],
        "merge_adapter": read_manifest(req.merge_adapter)["fingerprint"],
    }
    fp = fingerprint(lineage)
    out = merged_path(artifacts, req.base_dir.name, fp)
    if intact_manifest(out) is None:
        with atomic_dir(out) as staging:
            _stage_model(dataclasses.replace(req, merged_dir=None), staging)
            write_manifest(staging, "base", fp, lineage)
    return out


def _copy_lora(registry: Registry, adapter: Path) -> dict[str, Any]:
    """The adapter's row, copying it into releases/loras/ the first time (atomically)."""
    manifest = intact_manifest(adapter)
    if manifest is None:
        raise NimmerError(f"adapter {adapter} is incomplete or changed (its manifest does not match)")
    meta = read_metadata(adapter)
    lora_id = f"{meta['register']}-{manifest['fingerprint'][:12]}"
    row = registry.lora(lora_id)
    if row is not None:
        return row
    rel = f"loras/{lora_id}"
    with atomic_dir(registry.releases / rel) as staging:
        shutil.copytree(adapter, staging, dirs_exist_ok=True)
    files = [{k: f[k] for k in ("path", "sha256", "size")} for f in manifest["files"]]
    files.append(
        {
            "path": MANIFEST,
            "sha256": sha256_file(adapter / MANIFEST),
            "size": (adapter / MANIFEST).stat().st_size,
        }
    )
    return {
        "lora_id": lora_id,
        "register": meta["register"],
        "fingerprint": manifest["fingerprint"],
        "path": rel,
        "files": files,
        "trained_on_weights_sha256": meta["base"]["weights_sha256"],
        "mlflow_model_version": None,
        "new": True,
    }


def publish_version(releases: Path, signing_key: Path, req: PublishRequest) -> tuple[Version, bool]:
    """Publish ``req`` as the next version; returns (version, True) or the existing one and False."""
    key = load_private(signing_key)
    if not (req.base_dir / MANIFEST).exists():
        raise NimmerError(
            f"no built base at {req.base_dir} (no {MANIFEST}); run `python -m pipelines.build_base`"
        )
    base_manifest = read_manifest(req.base_dir)
    base_weights = base_identity(req.base_dir)["weights_sha256"]
    merged_meta = read_metadata(req.merge_adapter) if req.merge_adapter else None
    if merged_meta and merged_meta["base"]["weights_sha256"] != base_weights:
        raise NimmerError(
            f"adapter {req.merge_adapter} was trained on base {merged_meta['base']['label']}, not on "
            f"{req.base_dir.name}; merge it into the base it was trained on"
        )
    fp = content_fingerprint(req)
    registry = Registry.open(releases, create=True)
    try:
        existing = registry.by_fingerprint(fp)
        if existing is not None:
            return existing, False
        with registry.writing():
            for rel in registry.remove_leftovers():
                log.warning("removed %s, left by an interrupted publish", rel)
            existing = registry.by_fingerprint(fp)  # another publisher may have won the lock first
            if existing is not None:
                return existing, False
            version, rows = _publish_locked(registry, key, req, fp, base_manifest, base_weights, merged_meta)
            _drill("renamed")
            _insert(registry, version, rows)
        return registry.find(version), True
    finally:
        registry.close()


def _publish_locked(
    registry: Registry,
    key: Any,
    req: PublishRequest,
    fp: str,
    base_manifest: dict[str, Any],
    base_weights: str,
    merged_meta: dict[str, Any] | None,
) -> tuple[str, dict[str, Any]]:
    """Stage the next version's folder (model, card, signed manifest) and return its label and
    the registry rows that will make it visible."""
    versions = registry.versions()
    newest = versions[-1] if versions else None
    if req.carry is not None and (newest is None or newest.id != req.carry.previous.id):
        raise NimmerError(
            f"the LoRAs to carry were decided against {req.carry.previous.label}, but the registry's "
            f"newest version is now {newest.label if newest else 'none'} (another publish came "
            "first); publish again to decide against the newest"
        )
    label = label_of(registry.next_number())
    released_at = _now()
    parent = registry.by_weights(base_weights) if req.merge_adapter else None
    loras = [_copy_lora(registry, p) for p in req.adapters()]
    final = registry.releases / label
    url = (req.blob_base_url or final.parent.resolve().as_uri()).rstrip("/")
    with atomic_dir(final) as staging:
        _stage_model(req, staging)
        weights = sha256_file(staging / WEIGHTS)
        compat = _compatible_loras(req, label, loras, weights, merged_meta)
        manifest = _version_manifest(
            req, label, fp, released_at, base_manifest, merged_meta, parent, compat, weights
        )
        quantized = stage_quantized(staging, registry.releases, compat, weights, req.quantized)
        if quantized is not None:  # listed, hashed and signed with every other file
            manifest["quantized"] = quantized
        raw, signature = _write_signed(staging, manifest, req.license, url, label, key)
        _drill("staged")
    rows = {
        "manifest": manifest,
        "manifest_sha256": hashlib.sha256(raw).hexdigest(),
        "key_id": signature["key_id"],
        "parent": parent.id if parent else None,
        "loras": loras,
        "compat": compat,
        "carry": req.carry.registry_rows(manifest["version_id"], released_at) if req.carry else [],
    }
    return label, rows


def _compatible_loras(
    req: PublishRequest,
    label: str,
    loras: list[dict[str, Any]],
    weights: str,
    merged_meta: dict[str, Any] | None,
) -> list[dict[str, Any]]:
    """The register LoRAs that fit the new weights, each with how it relates to them: trained on
    them, or inherited after passing the rebase rule on them (``req.carry``); any other is an
    error, and so is the merged register's own LoRA."""
    compat = []
    inherited = (
        {d.lora_id for d in req.carry.decisions if d.decision == "inherited-evaluated"}
        if req.carry
        else set()
    )
    for lora in loras:
        if lora["register"] == merged_voice(merged_meta):
            raise NimmerError(
                f"LoRA {lora['lora_id']}: its register's voice is merged into {label}'s weights; "
                "it would apply twice"
            )
        if lora["trained_on_weights_sha256"] == weights:
            relation = "trained_on"
        elif lora["lora_id"] in inherited:
            relation = "inherited"
        else:
            raise NimmerError(
                f"LoRA {lora['lora_id']} was trained on other base weights "
                f"(sha256 {lora['trained_on_weights_sha256'][:12]}); it does not fit {label}"
            )
        # path and file hashes go into the signed manifest: loading trusts them, not the registry
        keep = ("lora_id", "register", "fingerprint", "path", "files")
        compat.append({**{k: lora[k] for k in keep}, "relation": relation})
    return compat


def _version_manifest(
    req: PublishRequest,
    label: str,
    fp: str,
    released_at: str,
    base_manifest: dict[str, Any],
    merged_meta: dict[str, Any] | None,
    parent: Version | None,
    compat: list[dict[str, Any]],
    weights: str,
) -> dict[str, Any]:
    """The version's manifest, all but its blob distribution (which lists the staged files)."""
    fed = (merged_meta or {}).get("federation", {})
    # an epsilon is published when its mechanism ran (> 0); None: no player data, or no guarantee
    # (fed["no_privacy"]). The counts from a federation are noised estimates (issue 20).
    epsilon_a2 = fed.get("epsilon_a2_record_level") or None
    # an epsilon above results.MEANINGFUL_EPSILON bounds nothing: its caveat (the federation's
    # metadata, one home for the wording) is said beside it, in the guarantees too
    caveats = privacy_caveats(fed) if fed else {}
    manifest: dict[str, Any] = {
        "format": FORMAT,
        "version_id": str(uuid.uuid4()),
        "version_label": label,
        "base_model_origin": _origin(base_manifest),
        "training_corpus_refs": _corpus_refs(req, base_manifest, merged_meta),
        "training_recipe_ref": _recipe_ref(req, base_manifest, merged_meta),
        "released_at": released_at,
        "differential_privacy_epsilon": epsilon_a2,
        "contributors_count": fed.get("contributors_a1", 0) + fed.get("uploads_a2", 0),
        "privacy": {
            "delta": fed.get("delta", 0.0),
            "epsilon_a1_user_level": fed.get("epsilon_a1_user_level") or None,
            "epsilon_a2_record_level": epsilon_a2,
            "no_privacy": bool(fed.get("no_privacy")),
            "mechanisms": fed.get("mechanisms", {}),
            "counts_noised": bool(fed.get("counts_noised")),
            "contributors_a1": fed.get("contributors_a1", 0),
            "uploads_a2": fed.get("uploads_a2", 0),
            # the privacy report (issue 14): each guarantee's level, the A.1 mechanism in full (N, q,
            # expected cohort, z, C, T, delta, accountant, sampling) and the empirical audit beside it
            "guarantees": {
                "A1_federated": _guarantee("user-level", caveats.get(A1)) if fed else None,
                "A2_anonymized": _guarantee("record-level", caveats.get(A2)) if fed else None,
            },
            "caveats": caveats,
            "a1_mechanism": fed.get("a1_mechanism"),
            "audit_epsilon_lower_bound": (fed.get("audit") or {}).get("audit_epsilon_lower_bound"),
            "audit": fed.get("audit"),
            # the record-level audit beside the A.2 epsilon: Secret-Sharer canary exposure, DP vs control
            "canary_exposure": fed.get("canary_exposure"),
        },
        "parent_version": parent.label if parent else None,
        "merged_adapter": _merged_adapter(req, merged_meta),
        "compatible_loras": compat,
        # what became of the previous version's LoRAs, decided on these weights before signing
        "lora_carry": req.carry.manifest_entry() if req.carry else None,
        "register_evaluation": req.evaluation,
        "voice_report": {**req.voice, "version": label} if req.voice else None,
        "content_fingerprint": fp,
        "weights_sha256": weights,
    }
    manifest["privacy"]["never_shared"] = manifest["training_corpus_refs"]["player_contributed"][
        "never_shared"
    ]
    return manifest


def _guarantee(level: str, caveat: str | None) -> str:
    """A tier's guarantee as published: its level, and beside it the caveat of an epsilon that
    bounds nothing ("user-level; NO MEANINGFUL GUARANTEE: epsilon 11,112 > 10 bounds nothing ...")."""
    return f"{level}; {caveat}" if caveat else level


def _recipe_ref(
    req: PublishRequest, base_manifest: dict[str, Any], merged_meta: dict[str, Any] | None
) -> dict[str, Any]:
    """How the weights were made: commits, the base's config and hash, the dataset fingerprints."""
    lineage = base_manifest["lineage"]
    return {
        "git_commit": req.recipe.get("git_commit", lineage.get("git_commit")),
        "base_git_commit": lineage.get("git_commit"),
        "base_config_hash": lineage["config_hash"],
        "base_config": {k: lineage[k] for k in ("model", "train")},
        "dataset_fingerprints": {
            "literary": lineage["dataset_fingerprint"],
            **({"synthetic": synth} if (synth := _merged_synth(merged_meta)) else {}),
        },
        "publish_config": req.recipe.get("config"),
    }


def _merged_adapter(req: PublishRequest, merged_meta: dict[str, Any] | None) -> dict[str, Any] | None:
    """The adapter merged into the weights and its federation's outcome; None for a plain base."""
    if not (merged_meta and req.merge_adapter):
        return None
    fed = merged_meta.get("federation", {})
    return {
        "register": merged_meta["register"],
        # the fresh adapter's spec when the federation started from one (artifacts.merged_voice:
        # the population's change to the base; the register keeps its LoRA), else None
        FRESH_START: merged_meta.get(FRESH_START),
        "fingerprint": read_manifest(req.merge_adapter)["fingerprint"],
        "federation": fed.get("fingerprint", ""),
        "rounds": fed.get("rounds", 0),
        # the federation as devices key their spend (its ledger's id, never a player's), the rounds
        # released into this adapter and its A.1 epsilon: a device that missed the server's outcome
        # learns from this signed manifest which of its rounds were released (memory/contributions)
        "federation_id": fed.get("federation_id"),
        "rounds_released": fed.get("rounds_released"),
        "rounds_done": fed.get("rounds_done"),
        "epsilon_a1_user_level": fed.get("epsilon_a1_user_level") or None,
        "delta": fed.get("delta"),
        "heldout_loss_before": fed.get("heldout_loss_before"),
        "heldout_loss_after": fed.get("heldout_loss_after"),
        "heldout_gain": fed.get("heldout_gain"),  # with its interval (federation.gain); None: not measured
    }


def _write_signed(
    staging: Path, manifest: dict[str, Any], license_id: str, url: str, label: str, key: Any
) -> tuple[bytes, dict[str, str]]:
    """The model card, then the manifest with every staged file's location, then its signature;
    returns (manifest bytes, signature)."""
    (staging / README).write_text(card.render(manifest, license_id))
    files = release_files(staging)
    manifest["blob_distribution"] = {
        "base_url": url,
        "files": [{**f, "location": f"{url}/{label}/{f['path']}"} for f in files],
    }
    raw = manifest_bytes(manifest)
    (staging / MANIFEST).write_bytes(raw)
    signature = sign(raw, key)
    (staging / SIGNATURE).write_bytes(signature_bytes(signature))
    return raw, signature


def _insert(registry: Registry, label: str, rows: dict[str, Any]) -> None:
    m = rows["manifest"]
    db = registry.db
    db.execute(
        "INSERT INTO base_model_versions (version_id, version_number, version_label, base_model_origin, "
        "training_corpus_refs, training_recipe_ref, released_at, differential_privacy_epsilon, "
        "contributors_count, blob_distribution, content_fingerprint, parent_version_id, manifest_sha256, "
        "signing_key_id, weights_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
        (
            m["version_id"],
            int(label.rsplit("v", 1)[1]),
            label,
            m["base_model_origin"],
            json.dumps(m["training_corpus_refs"], sort_keys=True),
            json.dumps(m["training_recipe_ref"], sort_keys=True),
            m["released_at"],
            m["differential_privacy_epsilon"],
            m["contributors_count"],
            json.dumps(m["blob_distribution"], sort_keys=True),
            m["content_fingerprint"],
            rows["parent"],
            rows["manifest_sha256"],
            rows["key_id"],
            m["weights_sha256"],
        ),
    )
    for lora in rows["loras"]:
        if lora.get("new"):
            db.execute(
                "INSERT INTO register_loras (lora_id, register, fingerprint, path, files, "
                "trained_on_weights_sha256) VALUES (?, ?, ?, ?, ?, ?)",
                (
                    lora["lora_id"],
                    lora["register"],
                    lora["fingerprint"],
                    lora["path"],
                    json.dumps(lora["files"]),
                    lora["trained_on_weights_sha256"],
                ),
            )
    for c in rows["compat"]:
        db.execute(
            "INSERT INTO lora_compat (lora_id, version_id, relation) VALUES (?, ?, ?)",
            (c["lora_id"], m["version_id"], c["relation"]),
        )
    for decision in rows["carry"]:
        if registry.lora(decision["lora_id"]) is not None:  # a refused LoRA never published has no row
            registry.record_rebase(decision)
    # federated_gradient_uploads gets no rows from a federation: under SecAgg+ the server never
    # learns who contributed (issue 20), so it has no per-contributor row to write
    db.execute(
        "INSERT INTO aliases (alias, version_id, set_at) VALUES ('candidate', ?, ?) "
        "ON CONFLICT(alias) DO UPDATE SET version_id = excluded.version_id, set_at = excluded.set_at",
        (m["version_id"], m["released_at"]),
    )
