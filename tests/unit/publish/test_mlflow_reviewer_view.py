"""What a reviewer reads in MLflow about a published version (issue 42): the model version's tags
carry both epsilons named by their level (never a bare ``epsilon`` that silently meant A.2), one
readable value per tag (no JSON), the long provenance as an artifact of the publish run named by
a tag; the publish run's metrics name both epsilons too, and its inputs are what it signs. A real
MLflow SQLite store, a real registry with a version merged from a federated adapter (its
federation block as publish_federated writes it, at experiment=demo's settings)."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import pytest
from mlflow import MlflowClient

from nimmer_train import tracking
from nimmer_train.config import TrackingConfig
from nimmer_train.federation import budget, checkpoint, results
from nimmer_train.loras.adapters import METADATA
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish import mlflow_registry
from nimmer_train.publish import stage as publish_stage
from nimmer_train.publish.listing import A1, A2, privacy_report
from nimmer_train.publish.registry import Registry
from nimmer_train.publish.release import PublishRequest, publish_version
from tests.helpers.compose import config
from tests.helpers.published import publish_registers


def _federation() -> dict:
    """The federation block publish_federated writes into a federated adapter's metadata, for
    experiment=demo's settings over its rounds (both tiers spent)."""
    s = config("experiment=demo").federated
    ledger = Ledger(s.delta)
    for _ in range(s.rounds):
        ledger.record((s.user_dp.noise_multiplier, s.user_dp.fraction_fit, 1), [(1.0, 1 / 16, 6)])
    state = checkpoint.ServerState(
        round=s.rounds,
        stopped="completed",
        records=[{"round": r + 1, "accepted": True, "a1_contributions_noised": 3.0} for r in range(s.rounds)],
        ledger=json.loads(json.dumps(ledger.__dict__)),
    )
    data = results.contributed_data(s, state)
    return {
        "fingerprint": "f" * 16, "rounds": s.rounds, "stopped": "completed", "no_privacy": False,
        "epsilon_a1_user_level": data["tiers"]["A1_federated"]["epsilon"],
        "epsilon_a2_record_level": data["tiers"]["A2_anonymized"]["epsilon"],
        "delta": s.delta, "mechanisms": data["mechanisms"], "caveats": data["caveats"],
        "counts_noised": True, "contributors_a1": 3, "uploads_a2": 2,
        "a1_mechanism": {**budget.mechanism_of(s).describe(), "rounds": s.rounds},
    }  # fmt: skip


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(releases, root): v1 (three register LoRAs) and v2, the base with a 'federated' adapter
    merged in (one of v1's LoRAs, its metadata given a federation block)."""
    root = tmp_path_factory.mktemp("reviewer_view")
    releases, _ = publish_registers(root)
    adapter = root / "adapters" / "drunk-scavenger"
    meta = json.loads((adapter / METADATA).read_text())
    meta |= {"federation": _federation(), "datasets": {"synth": "s" * 64}}
    (adapter / METADATA).write_text(json.dumps(meta))
    base = root / "base" / "tiny-serve"
    publish_version(releases, root / "keys" / "publisher.key", PublishRequest(base, merge_adapter=adapter))
    return releases, root


def _synced(releases: Path, root: Path) -> tuple[MlflowClient, str, dict[str, str]]:
    """A publish-like run that syncs the registry into MLflow and logs what publish logs."""
    uri = f"sqlite:///{root / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_experiment("reviewer-view")
    registry = Registry.open(releases)
    try:
        with mlflow.start_run() as run:
            numbers = mlflow_registry.sync(registry, uri, run.info.run_id)
            versions = registry.versions()
            for version in versions:
                publish_stage._log_signed_inputs(version, releases)
            mlflow.log_metrics(publish_stage._privacy_metrics(versions[-1]))
    finally:
        registry.close()
    return MlflowClient(uri), run.info.run_id, numbers


def test_model_versions_carry_both_labelled_epsilons_in_single_value_tags(
    published: tuple[Path, Path],
) -> None:
    releases, root = published
    client, _, numbers = _synced(releases, root)
    v2 = client.get_model_version(mlflow_registry.BASE_MODEL, numbers["nimmerworld-base-v2"])
    report = privacy_report(releases / "nimmerworld-base-v2")
    assert (
        report[A1] > report[A2] > 0
    )  # the user-level figure is the larger: the one shown as "epsilon" was A.2
    tags = v2.tags
    assert tags[A1] == f"{report[A1]:.3f}" and tags[A2] == f"{report[A2]:.3f}"
    assert "epsilon" not in tags and "corpus_refs" not in tags and "recipe_ref" not in tags
    assert tags["dp_delta"] == f"{report['delta']:g}" and tags["dp_population_n"] == str(
        report["a1_mechanism"]["population"]
    )
    assert tags["consent.A1_federated.contributors_noised"] == "3"
    assert tags["consent.A2_anonymized.uploads_noised"] == "2"
    assert any(k.startswith("corpus.") for k in tags)
    bad = {k: v for k, v in tags.items() if v.lstrip().startswith(("{", "["))}
    assert not bad, f"JSON in tags: {bad}"
    v1 = client.get_model_version(mlflow_registry.BASE_MODEL, numbers["nimmerworld-base-v1"]).tags
    assert v1[A1] == v1[A2] == "none: no player data in this version"
    assert "dp_delta" not in v1 and "consent.A1_federated.guarantee" not in v1
    # the long provenance: an artifact of the publish run, named by the version's tag
    assert tags["provenance"].startswith("runs:/")  # the publish run that first synced it
    assert tags["provenance"].endswith(f"/nimmerworld-base-v2/{mlflow_registry.PROVENANCE}")
    provenance = mlflow.artifacts.load_dict(tags["provenance"])
    assert provenance["privacy"][A1] == report[A1]
    assert provenance["training_corpus_refs"]["player_contributed"]["A1_federated"]["contributors"] == 3


def test_publish_run_names_both_epsilons_and_logs_what_it_signs(published: tuple[Path, Path]) -> None:
    releases, root = published
    client, run_id, _ = _synced(releases, root)
    run = client.get_run(run_id)
    report = privacy_report(releases / "nimmerworld-base-v2")
    assert run.data.metrics[A1] == pytest.approx(report[A1])
    assert run.data.metrics[A2] == pytest.approx(report[A2])
    assert run.data.metrics["dp_delta"] == pytest.approx(report["delta"])
    assert not any(k == "epsilon" or k == "differential_privacy_epsilon" for k in run.data.metrics)
    inputs = {(d.dataset.name, d.dataset.digest): d for d in run.inputs.dataset_inputs}
    names = {name for name, _ in inputs}
    assert {"nimmerworld-base-v1 weights", "nimmerworld-base-v2 weights"} <= names
    assert "federated adapter drunk-scavenger" in names
    assert sum(name.startswith("lora ") for name in names) >= 3
    manifest = json.loads((releases / "nimmerworld-base-v2" / "manifest.json").read_text())
    weights = next(d for (name, _), d in inputs.items() if name == "nimmerworld-base-v2 weights")
    assert {t.key: t.value for t in weights.tags}["sha256"] == manifest["weights_sha256"]


def test_a_version_tagged_by_an_older_release_is_retagged(published: tuple[Path, Path]) -> None:
    """A model version registered before issue 42 (a bare ``epsilon`` that meant A.2, JSON corpus
    refs) loses those tags on the next sync and gains the labelled ones."""
    releases, root = published
    client, _, numbers = _synced(releases, root)
    number = numbers["nimmerworld-base-v2"]
    for key, value in {"epsilon": "0.9", "corpus_refs": '{"literary": {}}'}.items():
        client.set_model_version_tag(mlflow_registry.BASE_MODEL, number, key, value)
    client.delete_model_version_tag(mlflow_registry.BASE_MODEL, number, A1)
    _synced(releases, root)
    tags = client.get_model_version(mlflow_registry.BASE_MODEL, number).tags
    assert "epsilon" not in tags and "corpus_refs" not in tags and A1 in tags


def test_the_review_command_opens_the_runs_table(published: tuple[Path, Path], tmp_path: Path) -> None:
    """The printed command runs the venv's mlflow (not on PATH in a fresh shell) with absolute
    paths, and the URL opens the runs table (MLflow 3.17 opens its GenAI view without
    workflowType=machine_learning)."""
    missing = TrackingConfig(store=str(tmp_path / "mlflow.db"), artifact_root=str(tmp_path / "a"))
    assert "#/experiments?workflowType=machine_learning" in tracking.ui_command(missing)  # no store yet
    assert not (tmp_path / "mlflow.db").exists()  # asking created nothing
    root = published[1]
    cfg = TrackingConfig(store=str(root / "mlflow.db"), artifact_root=str(root / "mlartifacts"))
    mlflow.set_tracking_uri(cfg.tracking_uri())
    exp = tracking.experiment_id(cfg, "run_all")
    command, url, models = tracking.ui_command(cfg).split("\n")
    mlflow_bin, *args = command.split()
    assert Path(mlflow_bin).is_absolute() and Path(mlflow_bin).is_file() and args[0] == "ui"
    assert f"sqlite:///{root / 'mlflow.db'}" in args and str(root / "mlartifacts") in args
    assert url.endswith(f"http://127.0.0.1:5000/#/experiments/{exp}/runs?{tracking.RUNS_TABLE}")
    assert "workflowType=machine_learning" in url and "orderByKey=attributes.run_name" in url
    assert models.strip().endswith("#/models?workflowType=machine_learning)")
