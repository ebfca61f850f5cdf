"""The model card leads with what a reader wants (issue 38): three sample turns per register, the
voice table, the epsilon with the population it is over, the federated adapter's gain (a gain that
is zero or negative is said so), the audit's result; then the model, its data and the rest."""

from __future__ import annotations

import json

from nimmer_train.publish import card
from nimmer_train.voice.quality import GeneratedTurn, score, seed_classifier
from tests.helpers import REPO


def _voice() -> dict:
    """A voice report scored from the seed set's own replies (six per register, one per scene)."""
    rows = [
        json.loads(line) for line in (REPO / "data/seed/teacher_replay_v1.jsonl").read_text().splitlines()
    ]
    turns, taken = [], set()
    for row in rows:
        if (row["register"], row["scene"]) not in taken:
            taken.add((row["register"], row["scene"]))
            turns.append(GeneratedTurn(row["register"], row["response"]["content"], scene=row["scene"]))
    settings = {"turns_per_register": 6, "max_new_tokens": 160, "seed": 0, "scenes": ["s"]}
    classifier = seed_classifier(REPO / "data/seed/teacher_replay_v1.jsonl")
    return score(turns, classifier, "v2", settings).summary()


def _manifest(before: float, after: float) -> dict:
    mechanism = {
        "population": 10_000, "sample_rate": 0.001, "sampling": "Poisson", "expected_cohort": 10,
        "noise_multiplier": 0.45, "clipping_norm": 1.0, "rounds": 2, "delta": 1e-6,
        "accountant": "rdp", "noise_std": 0.045,
    }  # fmt: skip
    privacy = {
        "delta": 1e-6, "epsilon_a1_user_level": 4.57, "epsilon_a2_record_level": 2.0, "mechanisms": {},
        "contributors_a1": 20, "uploads_a2": 2, "never_shared": ["clasp"], "a1_mechanism": mechanism,
    }  # fmt: skip
    merged = {"register": "caste-preacher", "federation": "f" * 16, "rounds": 2, "fingerprint": "a" * 16,
              "heldout_loss_before": before, "heldout_loss_after": after}  # fmt: skip
    return {
        "version_label": "v2", "version_id": "id", "base_model_origin": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "released_at": "now", "parent_version": "v1", "merged_adapter": merged,
        "training_recipe_ref": {"git_commit": "abc", "base_config_hash": "0" * 16},
        "training_corpus_refs": {
            "literary": {"name": "lit", "fingerprint": "0" * 16},
            "player_contributed": {"A1_federated": {"contributors": 20}, "A2_anonymized": {"uploads": 2}},
        },
        "differential_privacy_epsilon": 2.0, "contributors_count": 22, "privacy": privacy,
        "voice_report": _voice(),
    }  # fmt: skip


def test_the_card_leads_with_samples_voices_epsilon_gain_and_audit_then_the_rest() -> None:
    text = card.render(_manifest(2.50, 2.40), "apache-2.0")
    order = [
        "## Sample turns",
        "## Voice report",
        "cluster bootstrap over the 6 scenes",
        "**The bar** (issue 38",
        "- [FAIL] register accuracy (all registers): 0.00 [0.00, 0.00] (goal >= 0.80)",
        "  - [pass] replies repeating a sentence more than 2 times: 0 (goal = 0)",
        "- A.1 user-level epsilon 4.570 at delta 1e-06 over a declared population of N = 10,000 players",
        "- Federated gain of the `caste-preacher` adapter",
        "- Empirical audit: not run for this version",
        "## Model",
        "## Training data",
        "## Privacy\n",
    ]
    at = [text.index(part) for part in order]
    assert at == sorted(at), [order[i] for i in range(len(at) - 1) if at[i] > at[i + 1]]
    samples = text[text.index("## Sample turns") : text.index("## Voice report")]
    for register in ("caste-preacher", "drunk-scavenger", "hivemind-broadcast"):
        block = samples.split(f"- **{register}**")[1].split("- **")[0]
        assert block.count("\n  - ") == 3  # three turns of each register
    assert "2.500 -> 2.400 nats (+0.100" in text and "did not improve" not in text
    # the voice table's figures carry their scene intervals; the bar names what fails
    table = text[text.index("| register | turns |") : text.index("**The bar**")]
    assert table.count(" [") >= 4 * 6 and "| **all** | 30 | 1.00 [1.00, 1.00] |" in table
    assert "- bar: 8 of 14 goals met; FAILS: register accuracy (all registers)," in text  # seed copies


def test_a_federated_gain_of_zero_or_less_is_said_on_the_card() -> None:
    text = card.render(_manifest(2.40, 2.45), "apache-2.0")
    assert (
        "(-0.050; no interval measured): **the federation did not improve the adapter at this epsilon**"
        in text
    )
