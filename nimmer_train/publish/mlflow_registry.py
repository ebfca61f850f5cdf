"""Mirror the version registry into the MLflow Model Registry: each version becomes a version of
the registered model ``nimmerworld-base`` (source: its release folder), tagged one value per tag
(:func:`version_tags`: both epsilons by name, delta, the population, contributor count, corpus
fingerprints, consent tiers, recipe, audit, signing key); the long provenance (corpus refs with
their sources, recipe, privacy report) is ``<label>/provenance.json`` of the publish run, named by
the ``provenance`` tag. Register LoRAs become versions of ``nimmerworld-lora-<register>`` tagged
with the base versions they fit. Aliases follow the registry's (``candidate`` on publish,
``production`` on promote); a LoRA model carries the same alias on its version that fits the
aliased base. Every registered model and version has a description. Idempotent: a sync after a
failure registers what is missing, and a sync retags every version (a version tagged by an older
release loses its bare ``epsilon`` and JSON tags)."""

from __future__ import annotations

import json
from typing import Any

from nimmer_train.artifacts import MANIFEST
from nimmer_train.publish.listing import A1, A2, caveat_label, privacy_report
from nimmer_train.publish.registry import Registry, Version

BASE_MODEL = "nimmerworld-base"
PROVENANCE = "provenance.json"  # <label>/provenance.json in the publish run's artifacts
LEGACY_TAGS = ("epsilon", "corpus_refs", "recipe_ref")  # bare or JSON-valued: retired (issue 42)
MANAGED_PREFIXES = ("consent.", "corpus.", "privacy_caveat.", "audit.", "recipe.")


def lora_model(register: str) -> str:
    return f"nimmerworld-lora-{register}"


def _epsilon(value: float | None, report: dict[str, Any]) -> str:
    """An epsilon as a tag value: the figure, "none: ..." where no guarantee was given (a
    mechanism without noise) or where no player data went in."""
    if value is not None:
        return f"{value:.3f}"  # as ``nimmer versions list`` shows it
    if report.get("no_privacy"):
        return "none: no privacy guarantee (federated.no_privacy)"
    return "none: no player data in this version"


def version_tags(version: Version) -> dict[str, str]:
    """The model version's tags, one readable value each (never JSON): what a reviewer reads on
    the model page. Both epsilons carry their level in their name; there is no bare ``epsilon``."""
    row, manifest = version.row, json.loads((version.folder / MANIFEST).read_text())
    report = privacy_report(version.folder)
    refs, recipe = row["training_corpus_refs"], row["training_recipe_ref"]
    tags = {
        "version_label": row["version_label"],
        "version_id": row["version_id"],
        A1: _epsilon(report.get(A1), report),
        A2: _epsilon(report.get(A2), report),
        "contributors_count": str(row["contributors_count"]),
        "recipe.git_commit": str(recipe.get("git_commit")),
        "recipe.base_config_hash": str(recipe.get("base_config_hash")),
        "signing_key_id": row["signing_key_id"],
        "weights_sha256": row["weights_sha256"],
        "parent_version": str(manifest.get("parent_version") or "-"),
    }
    player_data = report.get(A1) is not None or report.get(A2) is not None or report.get("no_privacy")
    if player_data:  # a delta, a population and tier guarantees only where a guarantee was stated
        tags["dp_delta"] = f"{report.get('delta') or 0.0:g}"
    for key, caveat in (report.get("caveats") or {}).items():
        tags[f"privacy_caveat.{key}"] = caveat_label(caveat)
    mechanism = report.get("a1_mechanism") or {}
    if mechanism.get("population") is not None:
        tags["dp_population_n"] = str(mechanism["population"])
    audit = report.get("audit") or {}
    if audit.get("audit_epsilon_lower_bound") is not None:
        tags["audit.epsilon_lower_bound"] = f"{audit['audit_epsilon_lower_bound']:.3f}"
        if "audit_conclusive" in audit:
            tags["audit.conclusive"] = str(bool(audit["audit_conclusive"])).lower()
    return tags | _corpus_tags(refs, bool(player_data))


def _corpus_tags(refs: dict[str, Any], player_data: bool) -> dict[str, str]:
    """``corpus.<name>`` = fingerprint per training corpus, and the consent tiers' figures each
    as its own ``consent.<tier>.<figure>`` (noised counts say so in their name; a tier's
    guarantee only where player data went in)."""
    literary, synthetic = refs.get("literary") or {}, refs.get("synthetic") or {}
    tags = {f"corpus.{literary.get('name', 'literary')}": str(literary.get("fingerprint"))}
    if synthetic.get("fingerprint"):
        tags["corpus.synthetic-r1"] = str(synthetic["fingerprint"])
    player = refs.get("player_contributed") or {}
    noised = "_noised" if player.get("counts_noised") else ""
    a1, a2 = player.get("A1_federated") or {}, player.get("A2_anonymized") or {}
    tags |= {
        "consent.opt_out.used": str(bool((player.get("opt_out") or {}).get("used"))).lower(),
        f"consent.A1_federated.contributors{noised}": str(a1.get("contributors", 0)),
        f"consent.A2_anonymized.uploads{noised}": str(a2.get("uploads", 0)),
        "consent.A3_pseudonymous_full.contributors": str(
            (player.get("A3_pseudonymous_full") or {}).get("contributors", 0)
        ),
        "consent.never_shared": ", ".join(player.get("never_shared") or []) or "-",
    }
    if player_data and a1.get("guarantee"):
        tags["consent.A1_federated.guarantee"] = str(a1["guarantee"])[:250]
    if player_data and a2.get("guarantee"):
        tags["consent.A2_anonymized.guarantee"] = str(a2["guarantee"])[:250]
    return tags


def provenance(version: Version) -> dict[str, Any]:
    """The long provenance a tag cannot hold readably: the corpus refs (with the literary
    sources), the recipe, the privacy report, the merged adapter, the parent and the LoRA carry."""
    manifest = json.loads((version.folder / MANIFEST).read_text())
    keys = ("training_corpus_refs", "training_recipe_ref", "privacy", "merged_adapter", "parent_version",
            "lora_carry", "content_fingerprint", "weights_sha256")  # fmt: skip
    return {"version_label": version.label, **{k: manifest.get(k) for k in keys}}


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
                tags=version_tags(version),
                description=f"{row['version_label']}: {row['base_model_origin']}",
            )
            registry.db.execute(
                "UPDATE base_model_versions SET mlflow_model_version = ? WHERE version_id = ?",
                (mv.version, version.id),
            )
            row["mlflow_model_version"] = mv.version
        numbers[version.label] = row["mlflow_model_version"]
        _retag(client, version, row["mlflow_model_version"], run_id)
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


def _retag(client: Any, version: Version, number: str, run_id: str | None) -> None:
    """Set the version's tags (:func:`version_tags`), drop the retired ones, and give it its
    provenance artifact in ``run_id`` (the publish run) when it has none yet."""
    current = client.get_model_version(BASE_MODEL, number).tags
    tags = version_tags(version)
    for key in current:  # retired, or one this version no longer has (a tag this module writes)
        ours = key.startswith(MANAGED_PREFIXES) or key in (A1, A2, "dp_delta", "dp_population_n")
        if key in LEGACY_TAGS or (ours and key not in tags):
            client.delete_model_version_tag(BASE_MODEL, number, key)
    for key, value in tags.items():
        if current.get(key) != value:
            client.set_model_version_tag(BASE_MODEL, number, key, value)
    if run_id and "provenance" not in current:
        path = f"{version.label}/{PROVENANCE}"
        client.log_dict(run_id, provenance(version), path)
        client.set_model_version_tag(BASE_MODEL, number, "provenance", f"runs:/{run_id}/{path}")
