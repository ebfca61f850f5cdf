"""What a federation leaves behind: the aggregated adapter in the register-LoRA format (PEFT
folder + ``nimmer_adapter.json`` + manifest), its round records, and a data card for the
contributed data that holds tiers, categories, noised counts, epsilon and delta, never content,
ids or an exact count of anyone's data.

Which figures are noised, and by which accounted mechanism:
- the A.1 contributions per round: the noisy indicator sum / s of each released round (the A.1
  Gaussian mechanism itself, std 2 z); the A.1 contributor count is a noised estimate from them
  (the largest, rounded, at least 0);
- the A.2 pool's uploads and examples per data category: Gaussian noise of std
  count_noise_multiplier * sqrt(2), one step of the A.2 record-level ledger.
Exact figures are the settings and the rounds run and released. The server's own observations
of its nodes (sampled, available, participants, dropped, rejected, reply sizes) are exact and no
epsilon covers them: they stay in its private checkpoint (``state.json``) and never reach
``rounds.json``, MLflow or a log line (:func:`public_record`). A node that refuses a round (consent
revoked, opt-out or A.2) shows there as a dropout: the server learns that a pseudonymous node did
not train that round, never who plays on it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from nimmer_train.artifacts import README, atomic_dir, write_json_atomic, write_manifest
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.budget import mechanism_of, planned_a2
from nimmer_train.federation.checkpoint import ServerState
from nimmer_train.federation.wire import A1_INDICATOR_SHARE
from nimmer_train.loras.adapters import METADATA, read_metadata
from nimmer_train.memory.consent import NEVER_SHARED
from nimmer_train.memory.entries import DATA_CATEGORIES
from nimmer_train.privacy.accounting import Ledger

ROUNDS = "rounds.json"
CONTRIBUTED = "contributed_data.json"
CARD = "data_card.md"
NO_GUARANTEE = "no privacy guarantee (federated.no_privacy)"
# Above this epsilon a published figure bounds nothing worth the name: "weak to no formal
# guarantee" (tier 3 of Ponomareva et al. 2023, "How to DP-fy ML": epsilon <= 1 strong, <= 10
# reasonable). The test preset ci_tiny (six contributors, z = 0.01: A.1 epsilon ~11,000) is such a
# plumbing run; every card and print of such a figure says so beside it.
MEANINGFUL_EPSILON = 10.0


def epsilons(settings: FederatedConfig, state: ServerState) -> dict[str, float | None]:
    """The federation's total epsilons from its ledger (rounds and the pool counts' release);
    None for both under ``no_privacy``, and for an unbounded one."""
    if settings.no_privacy:
        return {"a1_user_level": None, "a2_record_level": None}
    if not state.ledger:
        return {"a1_user_level": 0.0, "a2_record_level": 0.0}
    return Ledger.from_dict(state.ledger, settings.delta, None).spent()


def caveat(epsilon: float | None) -> str | None:
    """What to say beside a published epsilon above :data:`MEANINGFUL_EPSILON` (None: nothing)."""
    if epsilon is None or epsilon <= MEANINGFUL_EPSILON:
        return None
    return (
        f"NO MEANINGFUL GUARANTEE: epsilon {epsilon:,.0f} > {MEANINGFUL_EPSILON:g} bounds nothing "
        "(a plumbing run, such as experiment=ci_tiny's six contributors; docs/privacy.md)"
    )


def caveats(eps: dict[str, float | None]) -> dict[str, str]:
    """{epsilon key: caveat} for the published epsilons that need one (``epsilons``' keys)."""
    found = {f"epsilon_{k}": caveat(v) for k, v in eps.items()}
    return {k: v for k, v in found.items() if v}


def a2_ran(state: ServerState) -> bool:
    """Whether this server had an A.2 pool: a pooled DP-SGD run or the pool counts' release in its
    ledger, or a decision on the counts (a server without a pool never makes one)."""
    return state.pool_counts is not None or bool(state.ledger.get("a2"))


def mechanisms(settings: FederatedConfig, released_rounds: int, a2: bool = True) -> dict[str, str]:
    """Exactly what each published epsilon covers (the model card quotes these), from the
    configuration that ran: no line names a mechanism that did not (``a2``: the server had an
    A.2 pool; on-device DP-SGD only with ``local_dp.on_devices``)."""
    s, user, local = settings, settings.user_dp, settings.local_dp
    std_count = 1 / A1_INDICATOR_SHARE * user.noise_multiplier
    found = {
        "epsilon_a1_user_level": (
            "user-level (one player's whole contribution): DP-FedAvg, the Gaussian mechanism on the sum "
            "of the nodes' contributions (adapter update and A.1 indicator, clipped together to L2 norm "
            f"C = {user.clipping_norm:g}), noise multiplier z = {user.noise_multiplier:g}, divided by the "
            f"fixed expected cohort q N = {user.fraction_fit * s.nodes():g} (N = {s.nodes()}), nodes "
            f"Poisson-sampled at rate q = {user.fraction_fit:g}, one step per released round "
            f"({released_rounds}); it also "
            f"covers the noised A.1 contribution count of each round (std {std_count:.3g}). "
            "Opacus RDP accountant"
        ),
        "epsilon_a2_record_level": (
            "record-level (one pooled example): the A.2 node's DP-SGD on the anonymised pool (noise "
            f"multiplier {local.noise_multiplier:g}, per-example clip {local.max_grad_norm:g}, Poisson "
            f"batches over every pooled example at the public rate {planned_a2(s)[1]:.4g}, "
            f"{s.local.steps} steps per round, every A.2 run of every released round) and the "
            f"noised pool counts (Gaussian, noise multiplier {s.a2.count_noise_multiplier:g}, sensitivity "
            "sqrt(2)). Opacus RDP accountant"
            if a2
            else "nothing: this server had no A.2 pool (no A.2 training, no pool counts released)"
        ),
        "secure_aggregation": (
            "SecAgg+ (Flower): nodes send masked contributions and the server unmasks only their sum "
            "(its trust assumption: docs/privacy.md)"
            if s.secagg.enabled
            else "none (federated.secagg.enabled=false): the server saw each node's clipped "
            "contribution, its A.1 indicator included"
        ),
    }
    if local.on_devices:
        found["local_dp_a1_devices"] = (
            f"each A.1 device's own record-level DP-SGD (noise multiplier {local.noise_multiplier:g}) "
            "is accounted on the device only and not published"
        )
    return found


def a1_mechanism(settings: FederatedConfig) -> str:
    """The A.1 tier's pipeline as it ran: each step only where its setting turned it on."""
    parts = [
        "on-device DP-SGD" if settings.local_dp.on_devices else "plain local SGD on the devices",
        "client-side clipping",
        *(["SecAgg+"] if settings.secagg.enabled else []),
        "server Gaussian noise" if settings.user_dp.noise_multiplier > 0 else "no server noise (z = 0)",
    ]
    return ", ".join(parts)


# what a published round record holds beside the mechanism's settings (Mechanism.describe):
# the released, noised figures and the epsilons; never an exact node count (issue 43)
PUBLIC_ROUND_KEYS = (
    "round",
    "accepted",
    "reason",
    "a1_contributions_noised",
    "heldout_loss",
    "epsilon_a1_user_level",
    "epsilon_a2_record_level",
    "update_bytes",  # the adapter's size: public
)


def public_record(record: dict[str, Any], settings: FederatedConfig) -> dict[str, Any]:
    """A round record as it may leave the server (``rounds.json``, MLflow): only what an epsilon
    covers or the public settings fix; the exact node counts stay in the server's state."""
    keep = {*PUBLIC_ROUND_KEYS, *mechanism_of(settings).describe()}
    return {k: v for k, v in record.items() if k in keep}


def _noised_count(value: float | None) -> int:
    """A noised count as published: rounded, at least 0 (post-processing)."""
    return max(0, round(value)) if value is not None else 0


def contributed_data(settings: FederatedConfig, state: ServerState) -> dict[str, Any]:
    accepted = [r for r in state.records if r.get("accepted")]
    a1_per_round = [r["a1_contributions_noised"] for r in accepted]
    pool = state.pool_counts or {"released": False, "reason": "no A.2 pool on this server"}
    eps = epsilons(settings, state)
    a2 = a2_ran(state)
    return {
        "tiers": {
            "A1_federated": {
                "mechanism": a1_mechanism(settings),
                "guarantee": "none" if settings.no_privacy else "user-level",
                "contributions_per_round_noised": [round(v, 2) for v in a1_per_round],
                "contributors_noised": _noised_count(max(a1_per_round, default=None)),
                "data_categories": "as each device's consent allows; the server does not learn which",
                "epsilon": eps["a1_user_level"],
            },
            "A2_anonymized": {
                "mechanism": (
                    "on-device anonymisation, k-threshold intake, central DP-SGD"
                    if a2
                    else "none: no A.2 pool on this server"
                ),
                "guarantee": "none" if settings.no_privacy else "record-level",
                "uploads_noised": _noised_count(pool["uploads"]) if pool["released"] else None,
                "k": settings.a2.k,
                "data_categories_noised": (
                    {c: _noised_count(v) for c, v in pool["categories"].items()} if pool["released"] else None
                ),
                "counts_noise_std": pool.get("noise_std"),
                "counts_released": pool["released"] or pool.get("reason", ""),
                "epsilon": eps["a2_record_level"],
            },
        },
        "noised_figures": (
            "A.1 contributions per round and contributors (the A.1 mechanism's noisy indicator sum / s, std "
            f"{1 / A1_INDICATOR_SHARE * settings.user_dp.noise_multiplier:.3g}; contributors: the largest "
            "per-round figure, rounded, at least 0); A.2 uploads and examples per category (Gaussian, std "
            f"{pool.get('noise_std') or settings.a2.count_noise_multiplier * 2**0.5:.3g}, in the A.2 "
            "ledger). "
            + (
                "No privacy guarantee (federated.no_privacy): a noise std of 0 leaves a figure exact."
                if settings.no_privacy
                else "No exact count of anyone's data is published."
            )
        ),
        # a caveat leads the text of an epsilon that bounds nothing: the model card quotes it
        "mechanisms": {
            k: f"{caveats(eps)[k]}. {text}" if k in caveats(eps) else text
            for k, text in mechanisms(settings, len(accepted), a2).items()
        },
        "caveats": caveats(eps),
        "no_privacy": settings.no_privacy,
        "never_shared": sorted(NEVER_SHARED),
        "eligible_categories": [c for c in DATA_CATEGORIES if c not in NEVER_SHARED],
        "delta": settings.delta,
        "rounds_completed": len(accepted),
        "rounds_run": len(state.records),
        "stopped": state.stopped,
        "noise_multiplier": settings.user_dp.noise_multiplier,
        "clipping_norm": settings.user_dp.clipping_norm,
        "sampling_rate": settings.user_dp.fraction_fit,
        "min_participants": settings.min_participants,
        "secure_aggregation": settings.secagg.enabled,
        "a2_pool": a2,
        "local_dp": {
            "on_devices": settings.local_dp.on_devices,
            "noise_multiplier": settings.local_dp.noise_multiplier,
            "max_grad_norm": settings.local_dp.max_grad_norm,
            "steps_per_round": settings.local.steps,
        },
    }


def _eps(value: float | None, no_privacy: bool) -> str:
    if no_privacy:
        return NO_GUARANTEE
    if value is None:
        return "unbounded (no guarantee)"
    return f"{value:.3f}" + (" (no meaningful guarantee)" if caveat(value) else "")


def render_card(fp: str, register: str, data: dict[str, Any]) -> str:
    a1, a2 = data["tiers"]["A1_federated"], data["tiers"]["A2_anonymized"]
    cats = a2["data_categories_noised"]
    cats_text = ", ".join(f"{k} ~{v}" for k, v in cats.items()) if cats is not None else "not released"
    local = data["local_dp"]
    masked = "masked " if data.get("secure_aggregation", True) else ""
    no_privacy = data["no_privacy"]
    uploads = f"~{a2['uploads_noised']}" if a2["uploads_noised"] is not None else "not released"
    rows = [
        f"| A1_federated | {a1['guarantee']} | ~{a1['contributors_noised']} (noised) "
        f"| {a1['contributions_per_round_noised']} (noised) | {_eps(a1['epsilon'], no_privacy)} |",
        f"| A2_anonymized | {a2['guarantee']} | {uploads} uploads (noised; k = {a2['k']}) "
        f"| not published | {_eps(a2['epsilon'], no_privacy)} |",
    ]
    lines = [
        f"# Contributed data: federation {fp[:12]} ({register})",
        "",
        "Data that opted-in players contributed to this adapter. Noised counts and privacy figures only:",
        "this card never holds content, player ids, contributor ids or an exact count of anyone's data."
        if not no_privacy
        else "this card never holds content, player ids or contributor ids; without a privacy guarantee "
        "its counts carry only the configured noise (none at a noise multiplier of 0: exact).",
        "",
        f"| tier | guarantee | contributors | contributions per round | epsilon (delta {data['delta']:g}) |",
        "|---|---|---|---|---|",
        *rows,
        "",
        f"- **Noised figures**: {data['noised_figures']}",
        f"- **A.1**: {a1['mechanism']}. Noise multiplier {data['noise_multiplier']}, clipping norm "
        f"{data['clipping_norm']}, sampling rate {data['sampling_rate']}. A round is released only when at "
        f"least {data['min_participants']} real A.1 updates are in the {masked}sum (counted exactly, "
        "inside it, by the server: see docs/privacy.md).",
        f"- **A.2**: {a2['mechanism']}."
        + (
            f" DP-SGD noise multiplier {local['noise_multiplier']}, "
            f"{local['steps_per_round']} steps per round."
            if data.get("a2_pool", True)
            else ""
        ),
        f"- **Data categories**: eligible {', '.join(data['eligible_categories'])}; never "
        f"{', '.join(data['never_shared'])}. A.1: {a1['data_categories']}. A.2 pool (noised): {cats_text}.",
        f"- **Epsilon A.1** covers {data['mechanisms']['epsilon_a1_user_level']}.",
        f"- **Epsilon A.2** covers {data['mechanisms']['epsilon_a2_record_level']}.",
        f"- **Rounds**: {data['rounds_completed']} released of {data['rounds_run']} run; "
        f"stopped: {data['stopped']}.",
    ]
    if no_privacy:
        lines.insert(
            4, "**No privacy guarantee**: this federation ran with federated.no_privacy; no epsilon."
        )
    for text in data.get("caveats", {}).values():
        lines.insert(4, f"**{text}**")
    return "\n".join(lines) + "\n"


AUDIT_CANARIES = 1000  # canary contributors of the one-run audit
AUDIT_DIM = 10_000  # dimension of the canaries' random directions


def audit_report(settings: FederatedConfig, released_rounds: int) -> dict[str, Any] | None:
    """The one-run user-level audit (:mod:`nimmer_train.privacy.audit`, Steinke et al. 2023 with
    Andrew et al.'s random-direction canaries) of the mechanism as released: its empirical epsilon
    lower bound at 95 % confidence beside the accounted epsilon, each round released by the
    server's own aggregation (:mod:`nimmer_train.federation.strategy_audit`), with its ceiling and
    the canary count whose ceiling would pass the accounted epsilon (below it the audit cannot
    decide). None without privacy or rounds."""
    if settings.no_privacy or released_rounds < 1:
        return None
    import dataclasses

    from nimmer_train.federation.strategy_audit import audit_aggregator
    from nimmer_train.privacy import audit

    mechanism = dataclasses.replace(mechanism_of(settings), rounds=released_rounds)
    # control=True: the same audit at z = 0 says whether this one could have seen a leak at all
    # (at a small q T few canaries ever take part: the demo's bound is 0 whatever the noise)
    result = audit_aggregator(settings, mechanism, canaries=AUDIT_CANARIES, dim=AUDIT_DIM, control=True)
    return {
        "audit_epsilon_lower_bound": result.lower_bound,
        "audit_control_lower_bound": result.control_lower_bound,
        "audit_ceiling": result.ceiling,
        "audit_conclusive": result.conclusive,
        "audit_canaries_to_decide": audit.canaries_to_decide(mechanism),  # None: no m up to DECIDE_LIMIT
        "aggregator": result.aggregator,
        "theoretical_epsilon": result.theoretical_epsilon,
        "confidence": result.confidence,
        "canaries": result.canaries,
        "guesses": result.guesses,
        "correct": result.correct,
        "method": "one-run audit (Steinke, Nasr & Jagielski 2023), random-direction canary contributors "
        "(Andrew et al. 2024), each round released by the server's own aggregation "
        "(NoisyMean.aggregate_fit on the clients' clipped contributions; SecAgg+'s masking not run)",
    }


def publish_federated(
    out: Path,
    model: Any,
    start_adapter: Path,
    fp: str,
    settings: FederatedConfig,
    state: ServerState,
    exposure: dict[str, Any] | None = None,
    federation_id: str | None = None,
    heldout: tuple[list[dict[str, list[int]]], int] | None = None,
) -> dict[str, Any]:
    """Write the aggregated adapter with its records and card; visible only when complete.
    ``exposure``: the record-level canary audit (:mod:`nimmer_train.federation.exposure_audit`);
    ``federation_id``: the id devices key their spend by (``rounds.federation_id``), published
    with the rounds released so a device that missed the outcome message learns it from the version;
    ``heldout``: the server's held-out rows and pad id, for the gain over the start adapter with its
    interval (:func:`heldout_gain`; None: not measured)."""
    meta = read_metadata(start_adapter)
    data = contributed_data(settings, state)
    a1, a2 = data["tiers"]["A1_federated"], data["tiers"]["A2_anonymized"]
    meta["federation"] = {
        "fingerprint": fp,
        "federation_id": federation_id,
        "rounds_released": [int(r["round"]) for r in state.records if r.get("accepted")],
        "rounds_done": state.round,  # the rounds after it (a resumed federation) are not this adapter's
        "started_from": meta.get("training_config_hash"),
        "rounds": data["rounds_completed"],
        "stopped": state.stopped,
        "no_privacy": settings.no_privacy,
        "epsilon_a1_user_level": a1["epsilon"],
        "epsilon_a2_record_level": a2["epsilon"],
        "delta": settings.delta,
        "mechanisms": data["mechanisms"],
        "caveats": data["caveats"],  # epsilons above MEANINGFUL_EPSILON: what to say beside them
        # contributors_a1, uploads_a2: noised estimates, never exact (unless no_privacy set a noise to 0)
        "counts_noised": settings.user_dp.noise_multiplier > 0 and settings.a2.count_noise_multiplier > 0,
        "contributors_a1": a1["contributors_noised"],
        "uploads_a2": a2["uploads_noised"] or 0,
        # the A.1 guarantee's full statement: N, q, expected cohort, z, C, T (released), delta,
        # accountant, sampling; and the empirical audit's lower bound beside its epsilon
        "a1_mechanism": {**mechanism_of(settings).describe(), "rounds": data["rounds_completed"]},
        "audit": audit_report(settings, data["rounds_completed"]),
        "canary_exposure": exposure,  # beside the A.2 record-level epsilon; None: not run
        "heldout_loss_before": state.initial_loss,
        "heldout_loss_after": next(
            (r["heldout_loss"] for r in reversed(state.records) if "heldout_loss" in r), None
        ),
        "heldout_gain": heldout_gain(model, start_adapter, heldout) if heldout else None,
    }
    with atomic_dir(out) as staging:
        model.save_pretrained(staging)
        (staging / README).unlink(missing_ok=True)
        write_json_atomic(staging / METADATA, meta)
        write_json_atomic(staging / ROUNDS, [public_record(r, settings) for r in state.records])
        write_json_atomic(staging / CONTRIBUTED, data)
        (staging / CARD).write_text(render_card(fp, meta["register"], data))
        write_manifest(
            staging,
            "federated_adapter",
            fp,
            {"register": meta["register"], "base": meta["base"], **meta["federation"]},
        )
    return meta


def heldout_gain(
    model: Any, start_adapter: Path, heldout: tuple[list[dict[str, list[int]]], int]
) -> dict[str, Any]:
    """The model's adapter against the one it started from on the server's held-out rows: the
    gain in nats per token with its paired bootstrap interval over the held-out examples
    (:func:`nimmer_train.federation.gain.federated_gain`); the model keeps its adapter."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from nimmer_train.federation.gain import federated_gain
    from nimmer_train.federation.wire import get_arrays, set_arrays

    final = get_arrays(model)
    set_peft_model_state_dict(model, load_file(start_adapter / "adapter_model.safetensors"))
    start = get_arrays(model)
    set_arrays(model, final)
    rows, pad_id = heldout
    return federated_gain(model, start, rows, pad_id)
