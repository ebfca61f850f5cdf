"""Every mechanism a federation's outputs name is one that ran (issue 43): the demo trains its
devices with plain local SGD (``local_dp.on_devices: false``), yet its data card said "Local
DP-SGD on A.1 devices ... (noise multiplier 1)". The data card, ``contributed_data.json`` (the
adapter's metadata quotes its mechanisms) and the version's model card are read here for the
configurations that turn on-device DP-SGD, secure aggregation and the A.2 pool off and on."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from nimmer_train.config.federated import FederatedConfig, SecAggConfig
from nimmer_train.federation import checkpoint, results
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish import card
from tests.helpers.compose import config


def _published(settings: FederatedConfig, a2: bool = True) -> tuple[dict[str, Any], list[str]]:
    """contributed_data of a two-round federation of ``settings`` (``a2``: with an A.2 pool that
    trained and released its counts) and every text published from it: the data card, the JSON's
    strings and the model card of a version that merges it."""
    ledger = Ledger(settings.delta)
    a1 = (settings.user_dp.noise_multiplier, settings.user_dp.fraction_fit, 1)
    for _ in range(2):
        ledger.record(a1, [(1.0, 1 / 16, 6)] if a2 else [])
    state = checkpoint.ServerState(
        round=2,
        stopped="completed",
        records=[{"round": r, "accepted": True, "a1_contributions_noised": 20.0} for r in (1, 2)],
        ledger=json.loads(json.dumps(dataclasses.asdict(ledger))),
        pool_counts={"released": True, "uploads": 2.4, "categories": {"lore": 5.2}, "noise_std": 7.07}
        if a2
        else None,
    )
    data = results.contributed_data(settings, state)
    tiers = data["tiers"]
    privacy = {
        "delta": settings.delta,
        "epsilon_a1_user_level": tiers["A1_federated"]["epsilon"],
        "epsilon_a2_record_level": tiers["A2_anonymized"]["epsilon"] or None,
        "mechanisms": data["mechanisms"],
        "contributors_a1": 20,
        "uploads_a2": 2,
        "never_shared": ["clasp"],
    }
    manifest = {
        "version_label": "v2",
        "version_id": "id",
        "base_model_origin": "scratch:llama-tiny",
        "released_at": "now",
        "parent_version": None,
        "merged_adapter": None,
        "training_recipe_ref": {"git_commit": "abc", "base_config_hash": "0" * 16},
        "training_corpus_refs": {
            "literary": {"name": "lit", "fingerprint": "0" * 16},
            "player_contributed": {"A1_federated": {"contributors": 20}, "A2_anonymized": {"uploads": 2}},
        },
        "differential_privacy_epsilon": privacy["epsilon_a2_record_level"],
        "contributors_count": 22,
        "privacy": privacy,
    }
    texts = [
        results.render_card("f" * 16, "drunk-scavenger", data),
        card.render(manifest, "apache-2.0"),
        *_strings(data),
    ]
    return data, [line for text in texts for line in text.splitlines()]


def _strings(value: Any, path: str = "") -> list[str]:
    """Every string in ``value`` as "path: text" (a tier's or mechanism's key says what it is about)."""
    if isinstance(value, str):
        return [f"{path}: {value}"]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in _strings(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v, path)]
    return []


def _about_a2(line: str) -> bool:
    low = line.lower()
    return ("a.2" in low or "a2" in low) and "a.1" not in low and "a1" not in low


def _device_dp_sgd(lines: list[str]) -> list[str]:
    """Lines that say DP-SGD ran anywhere but on the A.2 pool (a device's, an A.1 node's)."""
    return [line for line in lines if "DP-SGD" in line and not _about_a2(line)]


def test_on_device_dp_sgd_is_published_only_when_the_devices_ran_it() -> None:
    demo = config("experiment=demo").federated
    assert not demo.local_dp.on_devices  # the demo's devices train with plain local SGD
    data, lines = _published(demo)
    assert _device_dp_sgd(lines) == [], _device_dp_sgd(lines)
    assert "local_dp_a1_devices" not in data["mechanisms"] and not data["local_dp"]["on_devices"]
    assert data["tiers"]["A1_federated"]["mechanism"].startswith("plain local SGD on the devices")
    # the A.2 node's DP-SGD did run, and is still said
    assert any("the A.2 node's DP-SGD on the anonymised pool" in line for line in lines)
    on = dataclasses.replace(demo, local_dp=dataclasses.replace(demo.local_dp, on_devices=True))
    data, lines = _published(on)
    assert data["tiers"]["A1_federated"]["mechanism"].startswith("on-device DP-SGD")
    assert any(line.startswith("- Local DP-SGD on A.1 devices: ") for line in lines)


def test_secure_aggregation_is_claimed_only_when_it_ran() -> None:
    settings = FederatedConfig(min_participants=3)
    _, lines = _published(settings)
    assert any("Secure aggregation: SecAgg+" in line for line in lines)
    assert any("real A.1 updates are in the masked sum" in line for line in lines)
    plain = dataclasses.replace(settings, secagg=SecAggConfig(enabled=False))
    data, lines = _published(plain)
    assert [line for line in lines if "SecAgg" in line or "masked" in line] == []
    assert data["mechanisms"]["secure_aggregation"].startswith("none (federated.secagg.enabled=false)")
    assert not data["secure_aggregation"]


def test_a_server_without_an_a2_pool_claims_no_a2_training() -> None:
    data, lines = _published(FederatedConfig(min_participants=3), a2=False)
    assert [line for line in lines if "DP-SGD" in line and _about_a2(line)] == []
    assert data["mechanisms"]["epsilon_a2_record_level"].startswith("nothing: this server had no A.2 pool")
    assert data["tiers"]["A2_anonymized"]["mechanism"] == "none: no A.2 pool on this server"
