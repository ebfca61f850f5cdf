"""The model card of a published version, in the Hugging Face format (YAML front matter + Markdown).

It holds aggregate privacy figures only: epsilon, delta and contributor counts, never an id."""

from __future__ import annotations

from typing import Any

import yaml


def _fmt(value: float | None) -> str:
    return "none (no player data)" if value is None else f"{value:.3f}"


def render(manifest: dict[str, Any], license_: str) -> str:
    refs = manifest["training_corpus_refs"]
    privacy = manifest["privacy"]
    player = refs["player_contributed"]
    datasets = [f"nimmerworld/{refs['literary']['name']}-{refs['literary']['fingerprint'][:12]}"]
    if refs.get("synthetic"):
        datasets.append(f"nimmerworld/synthetic-r1-{refs['synthetic']['fingerprint'][:12]}")
    front: dict[str, Any] = {
        "license": license_,
        "language": ["en"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["nimmerworld", "npc-dialogue", "differential-privacy", "federated-learning"],
        "datasets": datasets,
        "model_name": manifest["version_label"],
    }
    if manifest.get("parent_version"):
        front["base_model"] = manifest["parent_version"]
        front["base_model_relation"] = "merge"
    elif not manifest["base_model_origin"].startswith("scratch:"):
        front["base_model"] = manifest["base_model_origin"]
        front["base_model_relation"] = "finetune"
    lit = refs["literary"]
    merged = manifest.get("merged_adapter")
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        f"# {manifest['version_label']}",
        "",
        "The nimmerworld base language model that gives nimmerworld's NPCs their voices; register "
        "trait-LoRAs ride on it, one per NPC turn.",
        "",
        "## Model",
        "",
        f"- Origin: `{manifest['base_model_origin']}`"
        + (f"; parent version `{manifest['parent_version']}`" if manifest.get("parent_version") else ""),
        f"- Released: {manifest['released_at']}; version id `{manifest['version_id']}`",
        f"- Recipe: git `{manifest['training_recipe_ref']['git_commit']}`, base config hash "
        f"`{manifest['training_recipe_ref']['base_config_hash'][:12]}`",
    ]
    if merged:
        lines.append(
            f"- Merged into the weights: the `{merged['register']}` adapter after federated rounds "
            f"(federation `{merged['federation'][:12]}`, {merged['rounds']} rounds)"
        )
    lines += [
        "",
        "## Training data",
        "",
        f"- Literary corpus `{lit['name']}` (public domain): {lit.get('works', '?')} works, "
        f"{lit.get('tokens', '?')} training tokens ({lit.get('token_unit', 'unknown')}), "
        f"fingerprint `{lit['fingerprint'][:12]}`",
    ]
    if refs.get("synthetic"):
        lines.append(
            f"- Teacher-tier synthetic dialogue (r1), fingerprint `{refs['synthetic']['fingerprint'][:12]}`"
        )
    lines += [
        f"- Player data: A.1 federated {player['A1_federated']['contributors']} contributors, "
        f"A.2 anonymized {player['A2_anonymized']['uploads']} uploads, A.3 none, opt-out players never.",
        "",
        "## Intended use",
        "",
        "Generating in-world NPC dialogue for nimmerworld, as the substrate for register trait-LoRAs, "
        "with the game's prompt DSL and structured JSON turns. Research on federated, differentially "
        "private fine-tuning of small dialogue models.",
        "",
        "## Limitations",
        "",
        "- A small model trained on a small corpus: fluent only within nimmerworld's registers and "
        "prone to repetition and invented facts outside them. Not for factual question answering, "
        "advice, or any use outside the game.",
        "- The literary corpus is 19th- and early 20th-century public-domain text and carries its "
        "era's biases.",
        "- Verify the manifest signature and checksums before loading (`nimmer versions verify`).",
        "",
        "## Privacy",
        "",
        f"- Delta: {privacy['delta']:g}",
        f"- A.1 federated (user-level DP): epsilon {_fmt(privacy['epsilon_a1_user_level'])}, "
        f"{privacy['contributors_a1']} contributors",
        f"- A.2 anonymized (record-level DP): epsilon {_fmt(privacy['epsilon_a2_record_level'])}, "
        f"{privacy['uploads_a2']} uploads",
        f"- differential_privacy_epsilon (the registry's figure, for A.2 contributions): "
        f"{_fmt(manifest['differential_privacy_epsilon'])}; "
        f"contributors_count: {manifest['contributors_count']}",
        "- Contributor ids are pseudonymous and are not part of this card; player ids never reach "
        f"the server. Never-shared data categories ({', '.join(privacy['never_shared'])}) are never used.",
        "",
    ]
    return "\n".join(lines)
