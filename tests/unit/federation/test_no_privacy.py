"""A federation without privacy (issue 20, item 7, and its review): no noise is refused unless
the experiment says ``no_privacy``; such a federation publishes no epsilon anywhere, and its data
and model cards never call its exact counts noised."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from nimmer_train.config.federated import A2Config, FederatedConfig, LocalDPConfig, UserDPConfig
from nimmer_train.errors import ConfigError
from nimmer_train.federation import checkpoint, results
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish import card

NO_NOISE = {
    "user_dp.noise_multiplier": {"user_dp": UserDPConfig(noise_multiplier=0.0)},
    "local_dp.noise_multiplier": {"local_dp": LocalDPConfig(noise_multiplier=0.0)},
    "a2.count_noise_multiplier": {"a2": A2Config(count_noise_multiplier=0.0)},
}


@pytest.mark.parametrize("name", sorted(NO_NOISE))
def test_no_noise_is_refused_unless_the_experiment_says_no_privacy(name: str) -> None:
    with pytest.raises(ConfigError, match=rf"federated\.{re.escape(name)}.*no_privacy"):
        FederatedConfig(**NO_NOISE[name])
    assert FederatedConfig(**NO_NOISE[name], no_privacy=True).no_privacy
    with pytest.raises(ConfigError, match="epsilon_budget"):
        FederatedConfig(no_privacy=True, epsilon_budget=8.0)
    presets = FederatedConfig(user_dp=UserDPConfig(noise_multiplier=0.01))  # the presets stay valid
    assert presets.user_dp.noise_multiplier == 0.01


def test_a_no_privacy_federation_publishes_no_epsilon(tmp_path: Path) -> None:
    settings = FederatedConfig(
        no_privacy=True,
        user_dp=UserDPConfig(noise_multiplier=0.0),
        local_dp=LocalDPConfig(noise_multiplier=0.0),
    )
    ledger = Ledger(settings.delta)
    ledger.record((0.0, 1.0, 1), [(0.0, 0.25, 6)])
    state = checkpoint.ServerState(
        round=1,
        stopped="completed",
        records=[{"round": 1, "accepted": True, "a1_contributions_noised": 3.0, "heldout_loss": 1.0}],
        ledger=json.loads(json.dumps(ledger.__dict__)),
        pool_counts={"released": True, "uploads": 2.4, "categories": {"lore": 5.2}, "noise_std": 7.07},
    )
    data = results.contributed_data(settings, state)
    assert (
        data["tiers"]["A1_federated"]["epsilon"] is None and data["tiers"]["A2_anonymized"]["epsilon"] is None
    )
    assert "No privacy guarantee" in results.render_card("f" * 16, "caste-preacher", data)
    manifest = {
        "version_label": "nimmerworld-base-v2",
        "version_id": "id",
        "base_model_origin": "scratch:llama-tiny",
        "released_at": "now",
        "parent_version": None,
        "merged_adapter": None,
        "training_recipe_ref": {"git_commit": "abc", "base_config_hash": "0" * 16},
        "training_corpus_refs": {
            "literary": {"name": "lit", "fingerprint": "0" * 16},
            "player_contributed": {
                "A1_federated": {"contributors": 3},
                "A2_anonymized": {"uploads": 2},
                "counts_noised": True,
            },
        },
        "differential_privacy_epsilon": None,
        "contributors_count": 5,
        "privacy": {
            "delta": 1e-5,
            "epsilon_a1_user_level": None,
            "epsilon_a2_record_level": None,
            "no_privacy": True,
            "counts_noised": True,
            "contributors_a1": 3,
            "uploads_a2": 2,
            "never_shared": ["clasp"],
        },
    }
    privacy = card.render(manifest, "apache-2.0").split("\n## Privacy\n")[1]
    assert "No privacy guarantee" in privacy and "epsilon" not in privacy.replace("no epsilon", "")


@pytest.mark.usefixtures("quiet")
def test_a_no_privacy_federations_card_does_not_call_exact_counts_noised() -> None:
    """Under no_privacy with noise multipliers of 0 the counts are exact: the data card used to
    say "no exact count of anyone's data is published", the model card "(noised estimate)"."""
    settings = FederatedConfig(
        no_privacy=True,
        user_dp=UserDPConfig(noise_multiplier=0.0),
        local_dp=LocalDPConfig(noise_multiplier=0.0),
        a2=A2Config(count_noise_multiplier=0.0),
    )
    state = checkpoint.ServerState(
        round=1,
        stopped="completed",
        records=[{"round": 1, "accepted": True, "a1_contributions_noised": 3.0}],
        pool_counts={
            "released": True,
            "uploads": 2.0,
            "categories": {"casual_dialog": 40.0},
            "noise_std": 0.0,
        },
    )
    data = results.contributed_data(settings, state)
    text = results.render_card("f" * 16, "caste-preacher", data)
    assert "exact count of anyone's data" not in text.replace("none at a noise multiplier of 0: exact", "")
    privacy = {"no_privacy": True, "counts_noised": True, "contributors_a1": 3, "uploads_a2": 2}
    lines = card._privacy_lines({"differential_privacy_epsilon": None, "contributors_count": 5}, privacy)
    assert not any("noised estimate" in line for line in lines)
