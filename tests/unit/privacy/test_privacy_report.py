"""Every published base carries its privacy report (issue 14, item 6): the model card and
``nimmer versions show`` state the guarantee, N, q, expected cohort, z, C, T, delta, epsilon, the
accountant, the audit's empirical lower bound beside the theoretical epsilon, and the A.2 pool's
canary exposure (DP beside a non-DP control) under the record-level epsilon."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from nimmer_train.artifacts import MANIFEST, README
from nimmer_train.cli.versions import show_version
from nimmer_train.config.federated import AuditConfig, FederatedConfig, LocalRecipeConfig
from nimmer_train.errors import ConfigError
from nimmer_train.federation.client import example_text
from nimmer_train.federation.exposure_audit import a2_recipe, canary_exposure, exposure_record
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.accounting import epsilon
from nimmer_train.privacy.dp_fedavg import Mechanism
from nimmer_train.privacy.dp_sgd import accounted_rate, public_sample_rate
from nimmer_train.privacy.exposure import CHANCE_BITS
from nimmer_train.publish import card
from nimmer_train.publish.listing import privacy_report
from tests.helpers.flower_deployment import tiny_release
from tests.helpers.tiny_lm import ALL_LINEAR, MICRO

MECHANISM = Mechanism(
    population=10_000, sample_rate=0.004, noise_multiplier=0.45, clip=1.0, rounds=3, delta=1e-6
)
PRIVACY = {
    "delta": 1e-6,
    "epsilon_a1_user_level": MECHANISM.epsilon(),
    "epsilon_a2_record_level": 3.2,
    "no_privacy": False,
    "mechanisms": {},
    "counts_noised": True,
    "contributors_a1": 95,
    "uploads_a2": 2,
    "guarantees": {"A1_federated": "user-level", "A2_anonymized": "record-level"},
    "a1_mechanism": MECHANISM.describe(),
    "audit_epsilon_lower_bound": 0.42,
    "audit": {
        "audit_epsilon_lower_bound": 0.42,
        "theoretical_epsilon": MECHANISM.epsilon(),
        "confidence": 0.95,
        "canaries": 1000,
        "guesses": 50,
        "correct": 31,
        "method": "one-run audit",
    },
}


def test_the_model_card_states_the_mechanism_and_the_audit_beside_epsilon() -> None:
    lines = "\n".join(
        card._privacy_lines({"differential_privacy_epsilon": 3.2, "contributors_count": 97}, PRIVACY)
    )
    assert f"epsilon {MECHANISM.epsilon():.3f}" in lines
    for text in ("N = 10,000", "q = 0.004", "poisson", "q N = 40", "z = 0.45", "C = 1", "T = 3", "1e-06"):
        assert text in lines, text
    assert "opacus.rdp" in lines and "noise std on the mean z C / (q N) = 0.0112" in lines
    assert "empirical audit: epsilon lower bound 0.420 at 95 % confidence" in lines
    assert f"beside the accounted {MECHANISM.epsilon():.3f}" in lines


def test_versions_show_prints_the_privacy_report_from_the_manifest(tmp_path: Path) -> None:
    (tmp_path / MANIFEST).write_text(json.dumps({"privacy": {**PRIVACY, "never_shared": ["clasp"]}}))
    report = privacy_report(tmp_path)
    assert report["a1_mechanism"]["population"] == 10_000 and report["a1_mechanism"]["sampling"] == "poisson"
    assert (
        report["audit_epsilon_lower_bound"] == 0.42 and report["guarantees"]["A1_federated"] == "user-level"
    )
    assert report["epsilon_a1_user_level"] == MECHANISM.epsilon() and "never_shared" not in report


@pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus's notes on secure RNG and alphas
def test_the_card_quotes_canary_exposure_under_the_a2_epsilon(tmp_path: Path) -> None:
    """A real (small) exposure run of the A.2 node's recipe, as the federate stage records it, in
    the card and in ``nimmer versions show``'s report (an untrained micro base: the figures' values
    are test_exposure's subject, their report is this test's)."""
    base, adapter, _ = tiny_release(tmp_path, MICRO, ALL_LINEAR)
    settings = FederatedConfig(local=LocalRecipeConfig(steps=3))
    pool = [example_text(e) for e in heldout_examples(24, seed=4)]
    report = canary_exposure(
        base, adapter, pool, a2_recipe(settings), rounds=2, delta=settings.delta, per_count=1,
        references=200, rng=np.random.default_rng(0),
    )  # fmt: skip
    exposure = exposure_record(report, rounds=2, a2_runs=1, control_steps=3, seconds=1.0)
    # the DP run is the node's mechanism: 2 rounds of 3 steps at the public rate, as accounted
    rate = accounted_rate(public_sample_rate(settings.local.batch_size, settings.local.max_examples))
    assert exposure["dp_epsilon"] == pytest.approx(epsilon([(1.0, rate, 6)], settings.delta), rel=1e-6)
    assert exposure["references"] == 200 and "dp_examples" not in exposure and "examples" not in exposure
    assert exposure["dp_mean_exposure_up_to_4x"] == pytest.approx(np.mean(report.dp[:2]))
    privacy = {**PRIVACY, "canary_exposure": exposure}
    lines = card._privacy_lines({"differential_privacy_epsilon": 3.2, "contributors_count": 97}, privacy)
    a2 = next(i for i, line in enumerate(lines) if line.startswith("- A.2 anonymized"))
    quoted = next(i for i, line in enumerate(lines) if "canary exposure:" in line)
    assert quoted > a2 and all(not lines[i].startswith("- ") for i in range(a2 + 1, quoted + 1))
    assert (
        f"canary exposure: DP {exposure['dp_mean_exposure_up_to_4x']:.2f} bits (control "
        f"{exposure['control_mean_exposure_up_to_4x']:.2f} bits; chance ≈ {CHANCE_BITS:.2f}) over 200 "
        "references"
    ) in lines[quoted]
    assert "1x: DP" in lines[quoted] and "16x: DP" in lines[quoted] and "3 steps per round" in lines[quoted]
    lacks_power = any("lack power" in line for line in lines)
    assert lacks_power == (not exposure["control_has_power"])  # said, never hidden
    weak = {**exposure, "control_mean_exposure": CHANCE_BITS, "control_has_power": False}
    assert any("lack power" in x for x in card._privacy_lines({"differential_privacy_epsilon": 3.2,
        "contributors_count": 97}, {**PRIVACY, "canary_exposure": weak}))  # fmt: skip
    (tmp_path / MANIFEST).write_text(json.dumps({"privacy": privacy}))
    assert privacy_report(tmp_path)["canary_exposure"]["references"] == 200


def test_a_published_version_with_an_a2_node_carries_its_canary_exposure(tiny_run: Path) -> None:
    """The shared ci_tiny run: its federation has an A.2 node, so the version that merged the
    federated adapter (v2) carries the exposure in its manifest, its card and versions show."""
    shown = show_version(tiny_run / "releases", "v2")
    exposure = shown["privacy"]["canary_exposure"]
    assert exposure is not None and exposure["references"] >= 100
    assert exposure["rounds"] >= 1 and exposure["dp_epsilon"] > 0
    manifest = json.loads((Path(shown["folder"]) / MANIFEST).read_text())
    assert manifest["privacy"]["canary_exposure"] == exposure
    text = (Path(shown["folder"]) / README).read_text()
    assert f"canary exposure: DP {exposure['dp_mean_exposure_up_to_4x']:.2f} bits" in text


def test_exposure_sizes_out_of_range_fail_naming_the_key() -> None:
    with pytest.raises(ConfigError, match="federated.audit.references"):
        FederatedConfig(audit=AuditConfig(references=10**6))  # no room for 10^6 other secrets of 10^6
    with pytest.raises(ConfigError, match="federated.audit.canaries"):
        FederatedConfig(audit=AuditConfig(canaries=-1))
