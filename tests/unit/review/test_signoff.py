"""A version's sign-off (publish/signoff.py, notebook 06, the publish run's MLflow description):
each goal judged from a release folder's manifest, pass only on a measured figure that meets its
bar (a missing figure reads "not measured"), both epsilons against the configured budget at the
stated delta, the audits' three outcomes, the carry decisions; set on a real MLflow run (SQLite
store) as its description after its own line; and over a real published version."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from nimmer_train.errors import NimmerError
from nimmer_train.publish import signoff
from nimmer_train.voice.quality import GOALS

VOICE_ROW = {"schema_valid": 1.0, "english_rate": 0.97, "register_accuracy": 0.85, "distinct_2": 0.6}
AUDIT = {
    "audit_epsilon_lower_bound": 1.2,
    "theoretical_epsilon": 5.17,
    "audit_conclusive": True,
    "audit_control_lower_bound": 4.1,
}
EXPOSURE = {
    "dp_mean_exposure_up_to_4x": 1.3,
    "control_mean_exposure_up_to_4x": 6.0,
    "chance_bits": 1.44,
    "control_has_power": True,
}
MANIFEST: dict[str, Any] = {  # the keys the sign-off reads, as publish writes them (a demo-like v2)
    "version_label": "nimmerworld-base-v2",
    "parent_version": "nimmerworld-base-v1",
    "voice_report": {
        "overall": {"register": "all", **VOICE_ROW},
        "registers": [{"register": r, **VOICE_ROW} for r in ("drunk-scavenger", "hivemind-broadcast")],
    },
    "privacy": {
        "delta": 1e-6,
        "epsilon_a1_user_level": 5.17,
        "epsilon_a2_record_level": 0.9,
        "no_privacy": False,
        "caveats": {},
        "audit": AUDIT,
        "canary_exposure": EXPOSURE,
    },
    "training_recipe_ref": {"publish_config": {"federated": {"epsilon_budget": 8.0, "delta": 1e-6}}},
    "compatible_loras": [{"register": "drunk-scavenger", "relation": "rebased"}],
    "merged_adapter": {"register": "hivemind-broadcast"},
    "lora_carry": {
        "from": "nimmerworld-base-v1",
        "decisions": [
            {"register": "drunk-scavenger", "decision": "rebased", "reason": "does not fit, retrained"},
            {"register": "hivemind-broadcast", "decision": "refused", "reason": "its voice is merged"},
        ],
    },
}
PARENT = {
    "version_label": "nimmerworld-base-v1",
    "compatible_loras": [
        {"register": "drunk-scavenger", "relation": "trained_on"},
        {"register": "hivemind-broadcast", "relation": "trained_on"},
    ],
}


def release(root: Path, manifest: dict[str, Any], parent: dict[str, Any] | None = PARENT) -> Path:
    """A releases folder with this version (and its parent) as publish lays them out."""
    if parent is not None:
        (root / parent["version_label"]).mkdir(parents=True, exist_ok=True)
        (root / parent["version_label"] / "manifest.json").write_text(json.dumps(parent))
    folder = root / manifest["version_label"]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def by_goal(folder: Path) -> dict[str, signoff.Goal]:
    return {f"{g.area}: {g.goal}": g for g in signoff.signoff(folder)}


def changed(**paths: Any) -> dict[str, Any]:
    """The demo-like manifest with dotted ``a__b`` keys replaced."""
    manifest = copy.deepcopy(MANIFEST)
    for dotted, value in paths.items():
        *parents, last = dotted.split("__")
        node = manifest
        for key in parents:
            node = node[key]
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    return manifest


def test_a_version_meeting_every_goal_is_signed_off(tmp_path: Path) -> None:
    goals = signoff.signoff(release(tmp_path, MANIFEST))
    assert {g.status for g in goals} == {signoff.PASS}, [g for g in goals if g.status != signoff.PASS]
    assert {g.area for g in goals} == {"voice", "epsilon", "audit", "carry"}
    assert signoff.verdict(goals).startswith("signed off")
    assert all(g.evidence.startswith("manifest.json: ") for g in goals)


def test_voice_goals_come_from_the_projects_one_home(tmp_path: Path) -> None:
    at_bar = {**VOICE_ROW, **GOALS}  # exactly at each goal of voice.quality.GOALS: a pass
    below = {**VOICE_ROW, "english_rate": GOALS["english_rate"] - 0.01}
    rows = [{"register": "drunk-scavenger", **at_bar}, {"register": "hivemind-broadcast", **below}]
    goals = by_goal(release(tmp_path, changed(voice_report__overall=at_bar, voice_report__registers=rows)))
    assert goals["voice: English rate (all registers)"].status == signoff.PASS
    assert goals["voice: English rate (all registers)"].target == f">= {GOALS['english_rate']:.2f}"
    assert goals["voice: register accuracy (drunk-scavenger)"].status == signoff.PASS
    low = changed(
        voice_report__registers=[{"register": "drunk-scavenger", **VOICE_ROW, "register_accuracy": 0.5}]
    )
    one = by_goal(release(tmp_path / "low", low))["voice: register accuracy (drunk-scavenger)"]
    assert one.status == signoff.FAIL and one.evidence.endswith("registers[0].register_accuracy")
    dull = by_goal(
        release(tmp_path / "dull", changed(voice_report__overall={**VOICE_ROW, "distinct_2": 0.3}))
    )
    assert dull["voice: distinct-2 (all registers)"].status == signoff.FAIL


def test_a_missing_figure_is_not_measured_never_a_pass(tmp_path: Path) -> None:
    goals = signoff.signoff(
        release(
            tmp_path, changed(voice_report=None, privacy__audit=None, privacy__epsilon_a2_record_level=None)
        )
    )
    missing = {g.goal: g for g in goals if g.status == signoff.NOT_MEASURED}
    assert {
        "schema-valid (all registers)",
        "register accuracy (each register)",
        "A.1 user-level audit",
    } <= set(missing)
    assert missing["A.2 record-level"].value == signoff.NOT_MEASURED
    assert all(g.value == signoff.NOT_MEASURED for g in missing.values())
    assert signoff.verdict(goals).startswith("not signed off") and "not measured" in signoff.verdict(goals)


def test_both_epsilons_against_the_budget_at_the_stated_delta(tmp_path: Path) -> None:
    def epsilon(name: str, manifest: dict[str, Any]) -> dict[str, signoff.Goal]:
        goals = by_goal(release(tmp_path / name, manifest))
        return {k.removeprefix("epsilon: "): g for k, g in goals.items() if k.startswith("epsilon")}

    ok = epsilon("ok", MANIFEST)
    assert ok["A.1 user-level"].value == "5.170" and ok["A.1 user-level"].target == "<= 8 at delta 1e-06"
    assert ok["A.2 record-level"].status == signoff.PASS
    over = epsilon("over", changed(privacy__epsilon_a1_user_level=9.5))
    assert over["A.1 user-level"].status == signoff.FAIL and over["A.2 record-level"].status == signoff.PASS
    recipe = {"publish_config": {"federated": {"epsilon_budget": None, "delta": 1e-6}}}
    unbudgeted = epsilon("none", changed(training_recipe_ref=recipe))
    assert unbudgeted["A.1 user-level"].status == signoff.NOT_MEASURED
    assert unbudgeted["A.1 user-level"].target == "no budget configured"
    other_delta = epsilon("delta", changed(privacy__delta=1e-5))
    assert other_delta["A.1 user-level"].status == signoff.FAIL and "not the configured" in (
        other_delta["A.1 user-level"].value
    )
    caveat = {"epsilon_a1_user_level": "NO MEANINGFUL GUARANTEE: epsilon 11,112 > 10 bounds nothing"}
    plumbing = epsilon("tiny", changed(privacy__epsilon_a1_user_level=11111.8, privacy__caveats=caveat))
    assert plumbing["A.1 user-level"].value == "11111.800 (NO MEANINGFUL GUARANTEE)"
    assert plumbing["A.1 user-level"].status == signoff.FAIL
    noiseless = epsilon("nodp", changed(privacy__no_privacy=True, privacy__epsilon_a1_user_level=None))
    assert noiseless["A.1 user-level"].status == signoff.FAIL
    first = {
        "delta": 0.0,
        "epsilon_a1_user_level": None,
        "epsilon_a2_record_level": None,
        "no_privacy": False,
    }
    no_data = epsilon("v1", changed(privacy=first))
    assert {g.status for g in no_data.values()} == {signoff.PASS} and no_data["A.1 user-level"].value == (
        "no player data"
    )


def test_audits_pass_fail_or_inconclusive(tmp_path: Path) -> None:
    def audit(name: str, manifest: dict[str, Any]) -> tuple[signoff.Goal, signoff.Goal]:
        a1, a2 = signoff.audit_goals(manifest)
        return a1, a2

    a1, a2 = audit("ok", MANIFEST)
    assert (a1.status, a2.status) == (signoff.PASS, signoff.PASS)
    leak, _ = audit("leak", changed(privacy__audit={**AUDIT, "audit_epsilon_lower_bound": 6.0}))
    assert leak.status == signoff.FAIL and "leaks more than accounted" in leak.value
    weak = {**AUDIT, "audit_conclusive": False, "audit_control_lower_bound": 0.0}
    blind, _ = audit("blind", changed(privacy__audit=weak))
    assert blind.status == signoff.INCONCLUSIVE and "control 0.000" in blind.value
    _, powerless = audit("a2", changed(privacy__canary_exposure={**EXPOSURE, "control_has_power": False}))
    assert powerless.status == signoff.INCONCLUSIVE
    _, memorised = audit(
        "mem", changed(privacy__canary_exposure={**EXPOSURE, "dp_mean_exposure_up_to_4x": 7.0})
    )
    assert memorised.status == signoff.FAIL
    missing, _ = audit("none", changed(privacy__audit=None))
    assert missing.status == signoff.NOT_MEASURED
    first = {"delta": 0.0, "epsilon_a1_user_level": None, "epsilon_a2_record_level": None}
    assert {g.status for g in audit("v1", changed(privacy=first))} == {signoff.NOT_APPLICABLE}


def test_carry_decisions_keep_every_registers_voice(tmp_path: Path) -> None:
    (carry,) = [g for g in signoff.signoff(release(tmp_path, MANIFEST)) if g.area == "carry"]
    assert carry.status == signoff.PASS and carry.goal.endswith("(from nimmerworld-base-v1)")
    assert "drunk-scavenger rebased (does not fit, retrained)" in carry.value
    assert "hivemind-broadcast merged into the weights" in carry.value
    lost = changed(merged_adapter=None)
    (carry,) = [g for g in signoff.signoff(release(tmp_path / "lost", lost)) if g.area == "carry"]
    assert carry.status == signoff.FAIL and carry.value.startswith("no voice for hivemind-broadcast")


def test_log_signoff_describes_the_publish_run(tmp_path: Path) -> None:
    """On a real MLflow store: the publish run's description keeps its own line, then one section
    per version (newest first) with links to the run's copies of the manifest and model card."""
    v1 = release(tmp_path / "releases", {**PARENT, "voice_report": MANIFEST["voice_report"]}, parent=None)
    v2 = release(tmp_path / "releases", MANIFEST)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.create_experiment("nimmer-run_all", artifact_location=(tmp_path / "mlartifacts").as_uri())
    run = client.create_run(exp, tags={signoff.NOTE: "Signed base versions with manifests"}).info.run_id
    for _ in range(2):  # a second call replaces the first's sign-off
        text = signoff.log_signoff(client, run, [v1, v2])
    tags = client.get_run(run).data.tags
    assert tags[signoff.NOTE] == text and text.startswith(
        "Signed base versions with manifests\n\n## Sign-off"
    )
    assert text.count(signoff.HEADING) == 1 and text.count("Signed base versions") == 1
    assert text.index("Sign-off: nimmerworld-base-v2") < text.index("Sign-off: nimmerworld-base-v1")
    assert f"(#/experiments/{exp}/runs/{run}/artifacts/nimmerworld-base-v2/manifest.json)" in text
    assert tags["signoff.nimmerworld-base-v2"].startswith("signed off")
    assert tags["signoff.nimmerworld-base-v1"].startswith("not signed off")  # no privacy block: not measured
    with pytest.raises(NimmerError, match="releases/<label>"):
        signoff.signoff(tmp_path / "nowhere")


def test_a_real_published_version(tmp_path: Path) -> None:
    """publish_version's own manifest (tests/helpers/published.py: no voice report, no player
    data) through the review functions notebook 06 calls."""
    from nimmer_train.review import signoff as review
    from nimmer_train.review.sources import sources
    from tests.helpers.published import publish_registers

    releases, _ = publish_registers(tmp_path, ("drunk-scavenger",))
    src = sources(tmp_path, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    table = review.versions(src)
    assert list(table["version"]) == ["nimmerworld-base-v1"]
    assert table.loc[0, "verdict"].startswith("not signed off") and table.loc[0, "not measured"] >= 5
    goals = review.goals(src, "v1").set_index("goal")
    assert goals.loc["schema-valid (all registers)", "status"] == signoff.NOT_MEASURED  # no voice report
    assert goals.loc["A.1 user-level", "value"] == "no player data"
    assert goals.loc["every register keeps a voice (first version)", "status"] == signoff.PASS
    assert goals.loc["A.1 user-level audit", "evidence"] == (
        f"{releases / 'nimmerworld-base-v1' / 'manifest.json'}: privacy.audit"
    )
    assert "### Sign-off: nimmerworld-base-v1" in review.markdown(src, "candidate")
