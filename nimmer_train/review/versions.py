"""The published versions as a reviewer checks them (notebook 04): the registry with aliases,
each version's signature and checksums verified here, the MLflow Model Registry's view, and a
diff of two versions (corpus refs, recipe, both epsilons, contributors, LoRAs that fit)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd

from nimmer_train.errors import NimmerError
from nimmer_train.publish.listing import A1, A2, caveat_label, privacy_report
from nimmer_train.publish.registry import REGISTRY_FILE, Registry
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import verify_version
from nimmer_train.review.sources import Sources
from nimmer_train.tracking import flatten

DIFF_FIELDS = (
    "base_model_origin",
    "training_corpus_refs",
    "training_recipe_ref",
    "contributors_count",
    "parent_version_id",
    "weights_sha256",
    "signing_key_id",
)

EPSILON_LABELS = {A1: "epsilon A.1 user-level", A2: "epsilon A.2 record-level"}


@contextlib.contextmanager
def registry(src: Sources) -> Iterator[Registry]:
    if not (src.releases / REGISTRY_FILE).exists():
        raise NimmerError(
            f"no version registry at {src.releases / REGISTRY_FILE}: nothing was published there "
            "(run_all with publish.enabled=true publishes), or pass releases_dir"
        )
    reg = Registry.open(src.releases)
    try:
        yield reg
    finally:
        reg.close()


def epsilons(folder: Path) -> dict[str, float | None]:
    """Both epsilons a version publishes, labelled, from its signed manifest (the registry's
    ``differential_privacy_epsilon`` is the A.2 record-level figure alone)."""
    report = privacy_report(folder)
    return {EPSILON_LABELS[k]: report.get(k) for k in EPSILON_LABELS}


def caveats(folder: Path) -> str:
    """What to say beside a version's epsilons: each one's caveat label where it bounds nothing
    ("epsilon A.1 user-level: NO MEANINGFUL GUARANTEE"), empty where none needs one."""
    said = privacy_report(folder).get("caveats") or {}
    return "; ".join(
        f"{EPSILON_LABELS[k]}: {caveat_label(v)}" for k, v in said.items() if k in EPSILON_LABELS
    )


def versions(src: Sources) -> pd.DataFrame:
    """One row per published version: label, aliases, when, origin, both epsilons (A.1
    user-level, A.2 record-level), contributors, LoRAs."""
    with registry(src) as reg:
        aliases = reg.aliases()
        rows = [
            {
                "version": v.label,
                "aliases": ", ".join(sorted(a for a, label in aliases.items() if label == v.label)),
                "released_at": v.row["released_at"],
                "origin": v.row["base_model_origin"],
                **epsilons(v.folder),
                "privacy caveat": caveats(v.folder),
                "contributors": v.row["contributors_count"],
                "loras": ", ".join(f"{x['register']} ({x['relation']})" for x in reg.loras_for(v)),
                "mlflow_model_version": v.row["mlflow_model_version"],
            }
            for v in reg.versions()
        ]
    return pd.DataFrame(rows)


def verify(src: Sources, trusted_keys: str | Path | None = None) -> pd.DataFrame:
    """Each version checked here as a loader would: the signature over manifest.json by a trusted
    key, the manifest the registry recorded, every file's sha256, the LoRAs that fit. ``ok`` is
    False with the loader's error when any check fails."""
    keyring = Keyring.load(Path(trusted_keys) if trusted_keys else src.workdir / "keys" / "trusted")
    rows = []
    with registry(src) as reg:
        for v in reg.versions():
            try:
                verified = verify_version(reg, v, keyring)
                files = len(verified.manifest["blob_distribution"]["files"])
                key = verified.manifest.get("signing_key_id", v.row["signing_key_id"])
                rows.append(
                    {
                        "version": v.label,
                        "ok": True,
                        "signed_by": key,
                        "files_checked": files,
                        "loras_checked": sum(len(f) for f in verified.lora_files.values()),
                    }
                )
            except NimmerError as exc:
                rows.append({"version": v.label, "ok": False, "error": str(exc)})
    return pd.DataFrame(rows)


def _row(reg: Registry, name: str) -> dict[str, Any]:
    version = reg.find(name)
    row = {k: version.row[k] for k in DIFF_FIELDS}
    row["training_recipe_ref"] = {
        k: v for k, v in row["training_recipe_ref"].items() if k != "publish_config"
    }  # the whole resolved config: in manifest.json and MLflow
    row.update(epsilons(version.folder))  # both, labelled (the registry's column is A.2's alone)
    row["loras"] = sorted(x["lora_id"] for x in reg.loras_for(version))
    return row


def diff(src: Sources, a: str, b: str) -> pd.DataFrame:
    """The fields that differ between versions ``a`` and ``b`` (labels, vN or aliases), nested
    refs flattened to dotted keys."""
    with registry(src) as reg:
        left, right = flatten(_row(reg, a)), flatten(_row(reg, b))
        names = (reg.find(a).label, reg.find(b).label)
    keys = sorted(set(left) | set(right))
    rows = [
        {"field": k, names[0]: left.get(k), names[1]: right.get(k)}
        for k in keys
        if left.get(k) != right.get(k)
    ]
    return pd.DataFrame(rows, columns=["field", *names])


def registered_models(src: Sources) -> pd.DataFrame:
    """The MLflow Model Registry: each model's description, aliases and latest version."""
    client = src.client()
    rows = []
    for model in client.search_registered_models():
        versions = client.search_model_versions(f"name = '{model.name}'")
        rows.append(
            {
                "model": model.name,
                "description": model.description,
                "aliases": ", ".join(f"{a}=v{n}" for a, n in sorted(model.aliases.items())),
                "versions": len(versions),
            }
        )
    return pd.DataFrame(rows)
