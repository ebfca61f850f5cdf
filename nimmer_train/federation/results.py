"""What a federation leaves behind: the aggregated adapter in the register-LoRA format (PEFT
folder + ``nimmer_adapter.json`` + manifest), its round records, and a data card for the
contributed data that holds tiers, categories, counts, epsilon and delta, never content or ids."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nimmer_train.artifacts import README, atomic_dir, write_json_atomic, write_manifest
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.rounds import ServerState
from nimmer_train.loras.adapters import METADATA, read_metadata
from nimmer_train.memory.consent import NEVER_SHARED
from nimmer_train.memory.entries import DATA_CATEGORIES

ROUNDS = "rounds.json"
CONTRIBUTED = "contributed_data.json"
CARD = "data_card.md"


def contributed_data(settings: FederatedConfig, state: ServerState, pool: dict[str, Any]) -> dict[str, Any]:
    accepted = [r for r in state.records if r.get("accepted")]
    last = accepted[-1] if accepted else {}
    a1_contributors = [c for c in state.contributors if c != "a2-pool"]
    return {
        "tiers": {
            "A1_federated": {
                "mechanism": "on-device DP-SGD, client-side clipping, SecAgg+, server Gaussian noise",
                "guarantee": "user-level",
                "contributors": len(a1_contributors),
                "examples_per_round": [r.get("examples_a1", 0) for r in accepted],
                "data_categories": "as each device's consent allows; the server does not learn which",
                "epsilon": last.get("epsilon_a1_user_level", 0.0),
            },
            "A2_anonymized": {
                "mechanism": "on-device anonymisation, k-threshold intake, central DP-SGD",
                "guarantee": "record-level",
                "uploads": pool["uploads"],
                "k": settings.a2_k,
                "examples_per_round": [r.get("examples_a2", 0) for r in accepted],
                "data_categories": pool["categories"],
                "epsilon": last.get("epsilon_a2_record_level", 0.0),
            },
        },
        "never_shared": sorted(NEVER_SHARED),
        "eligible_categories": [c for c in DATA_CATEGORIES if c not in NEVER_SHARED],
        "delta": settings.delta,
        "rounds_completed": len(accepted),
        "rounds_run": len(state.records),
        "stopped": state.stopped,
        "noise_multiplier": settings.noise_multiplier,
        "clipping_norm": settings.clipping_norm,
        "sampling_rate": settings.fraction_fit,
        "local_dp": {
            "noise_multiplier": settings.dp_noise_multiplier,
            "max_grad_norm": settings.dp_max_grad_norm,
            "steps_per_round": settings.local_steps,
        },
    }


def render_card(fp: str, register: str, data: dict[str, Any]) -> str:
    a1, a2 = data["tiers"]["A1_federated"], data["tiers"]["A2_anonymized"]
    cats = ", ".join(f"{k} {v}" for k, v in a2["data_categories"].items()) or "none"
    local = data["local_dp"]
    rows = [
        f"| A1_federated | {a1['guarantee']} | {a1['contributors']} pseudonymous "
        f"| {a1['examples_per_round']} | {a1['epsilon']:.3f} |",
        f"| A2_anonymized | {a2['guarantee']} | {a2['uploads']} uploads (k = {a2['k']}) "
        f"| {a2['examples_per_round']} | {a2['epsilon']:.3f} |",
    ]
    lines = [
        f"# Contributed data: federation {fp[:12]} ({register})",
        "",
        "Data that opted-in players contributed to this adapter. Counts and privacy figures only:",
        "this card never holds content, player ids or contributor ids.",
        "",
        f"| tier | guarantee | contributors | examples per round | epsilon (delta {data['delta']:g}) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"- **A.1**: {a1['mechanism']}. Noise multiplier {data['noise_multiplier']}, clipping norm "
        f"{data['clipping_norm']}, sampling rate {data['sampling_rate']}. Example counts are sums "
        "learnt through secure aggregation.",
        f"- **A.2**: {a2['mechanism']}. DP-SGD noise multiplier {local['noise_multiplier']}, "
        f"{local['steps_per_round']} steps per round.",
        f"- **Data categories**: eligible {', '.join(data['eligible_categories'])}; never "
        f"{', '.join(data['never_shared'])}. A.1: {a1['data_categories']}. A.2 pool: {cats}.",
        f"- **Rounds**: {data['rounds_completed']} released of {data['rounds_run']} run; "
        f"stopped: {data['stopped']}.",
    ]
    return "\n".join(lines) + "\n"


def publish_federated(
    out: Path,
    model: Any,
    start_adapter: Path,
    fp: str,
    settings: FederatedConfig,
    state: ServerState,
    pool: dict[str, Any],
) -> dict[str, Any]:
    """Write the aggregated adapter with its records and card; visible only when complete."""
    meta = read_metadata(start_adapter)
    data = contributed_data(settings, state, pool)
    meta["federation"] = {
        "fingerprint": fp,
        "started_from": meta.get("training_config_hash"),
        "rounds": data["rounds_completed"],
        "stopped": state.stopped,
        "epsilon_a1_user_level": data["tiers"]["A1_federated"]["epsilon"],
        "epsilon_a2_record_level": data["tiers"]["A2_anonymized"]["epsilon"],
        "delta": settings.delta,
        "contributors_a1": data["tiers"]["A1_federated"]["contributors"],
        "uploads_a2": pool["uploads"],
        "heldout_loss_before": state.initial_loss,
        "heldout_loss_after": next(
            (r["heldout_loss"] for r in reversed(state.records) if "heldout_loss" in r), None
        ),
    }
    with atomic_dir(out) as staging:
        model.save_pretrained(staging)
        (staging / README).unlink(missing_ok=True)
        write_json_atomic(staging / METADATA, meta)
        write_json_atomic(staging / ROUNDS, state.records)
        write_json_atomic(staging / CONTRIBUTED, data)
        (staging / CARD).write_text(render_card(fp, meta["register"], data))
        write_manifest(
            staging,
            "federated_adapter",
            fp,
            {"register": meta["register"], "base": meta["base"], **meta["federation"]},
        )
    return meta
