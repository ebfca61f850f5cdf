"""Mirror the version registry into the MLflow Model Registry: each version becomes a version of
the registered model ``nimmerworld-base`` (source: its release folder), tagged with epsilon,
contributor count, corpus and recipe refs; register LoRAs become versions of
``nimmerworld-lora-<register>`` tagged with the base versions they fit. Aliases follow the
registry's (``candidate`` on publish, ``production`` on promote); a LoRA model carries the same
alias on its version that fits the aliased base. Every registered model and version has a
description. Idempotent: a sync after a failure registers what is missing."""

from __future__ import annotations

import json
from typing import Any

from nimmer_train.publish.registry import Registry

BASE_MODEL = "nimmerworld-base"


def lora_model(register: str) -> str:
    return f"nimmerworld-lora-{register}"


def _tags(row: dict[str, Any]) -> dict[str, str]:
    refs = dict(row["training_corpus_refs"])
    refs["literary"] = {k: v for k, v in refs["literary"].items() if k != "sources"}
    recipe = row["training_recipe_ref"]
    return {
        "version_label": row["version_label"],
        "version_id": row["version_id"],
        "epsilon": str(row["differential_privacy_epsilon"]),
        "contributors_count": str(row["contributors_count"]),
        "corpus_refs": json.dumps(refs, sort_keys=True)[:4900],
        "recipe_ref": f"git:{recipe['git_commit']} base_config:{recipe['base_config_hash'][:12]}",
        "signing_key_id": row["signing_key_id"],
        "weights_sha256": row["weights_sha256"],
    }


def sync(registry: Registry, tracking_uri: str, run_id: str | None = None) -> dict[str, str]:
    """Register what MLflow lacks and set aliases; returns label -> MLflow version."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient(tracking_uri)

    def ensure(name: str, description: str) -> None:
        try:
            client.get_registered_model(name)
        except MlflowException:
            client.create_registered_model(name, description=description)

    ensure(BASE_MODEL, "Published nimmerworld bases (signed manifests; see each version's model card)")
    numbers: dict[str, str] = {}
    for version in registry.versions():
        row = version.row
        if row["mlflow_model_version"] is None:
            mv = client.create_model_version(
                BASE_MODEL,
                source=version.folder.resolve().as_uri(),
                run_id=run_id,
                tags=_tags(row),
                description=f"{row['version_label']}: {row['base_model_origin']}",
            )
            registry.db.execute(
                "UPDATE base_model_versions SET mlflow_model_version = ? WHERE version_id = ?",
                (mv.version, version.id),
            )
            row["mlflow_model_version"] = mv.version
        numbers[version.label] = row["mlflow_model_version"]
    for version in registry.versions():
        for lora in registry.loras_for(version):
            name = lora_model(lora["register"])
            if lora["mlflow_model_version"] is None:
                ensure(name, f"Register trait-LoRA {lora['register']} for nimmerworld bases")
                mv = client.create_model_version(
                    name,
                    source=(registry.releases / lora["path"]).resolve().as_uri(),
                    run_id=run_id,
                    tags={"lora_id": lora["lora_id"], "base_version": version.label},
                    description=f"{lora['register']} trait-LoRA {lora['lora_id']} for {version.label}",
                )
                registry.db.execute(
                    "UPDATE register_loras SET mlflow_model_version = ? WHERE lora_id = ?",
                    (mv.version, lora["lora_id"]),
                )
                lora["mlflow_model_version"] = mv.version
            fits = registry.fits(lora["lora_id"])
            client.set_model_version_tag(name, lora["mlflow_model_version"], "fits", ",".join(fits))
            client.set_model_version_tag(
                name,
                lora["mlflow_model_version"],
                "fits_mlflow_versions",
                ",".join(f"{BASE_MODEL}/{numbers[label]}" for label in fits),
            )
    for alias, label in registry.aliases().items():
        client.set_registered_model_alias(BASE_MODEL, alias, numbers[label])
        for lora in registry.loras_for(registry.find(label)):  # the LoRA that fits the aliased base
            name = lora_model(lora["register"])
            client.set_registered_model_alias(name, alias, lora["mlflow_model_version"])
    return numbers
