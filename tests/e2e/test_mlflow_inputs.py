"""What the tiny end-to-end run (experiment=ci_tiny) leaves in MLflow for a reviewer (issue 42):
every stage's run names its real inputs as MLflow datasets (the A.2 pool only in aggregate), the
federation's epsilon curves never turn back to step 0 and end on the published totals, and the
published versions and the publish run name both epsilons by level in single-value tags."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from mlflow import MlflowClient
from mlflow.entities import Run

from nimmer_train.federation import results
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.publish.listing import A1, A2

pytestmark = pytest.mark.slow


def _stage_runs(tiny_run: Path) -> tuple[MlflowClient, dict[str, list[Run]]]:
    """The run_all experiment's runs by stage tag (``lora <register>`` runs under ``lora``), each
    fetched whole (get_run: with its dataset inputs)."""
    client = MlflowClient(f"sqlite:///{tiny_run / 'mlflow.db'}")
    exp = client.get_experiment_by_name("nimmer-run_all")
    runs: dict[str, list[Run]] = {}
    for found in client.search_runs([exp.experiment_id]):
        stage = found.data.tags["stage"]
        runs.setdefault("lora" if stage.startswith("lora ") else stage, []).append(
            client.get_run(found.info.run_id)
        )
    return client, runs


def _inputs(run: Run) -> dict[str, dict[str, str]]:
    """{dataset name: its input tags (context included)}."""
    return {i.dataset.name: {t.key: t.value for t in i.tags} for i in run.inputs.dataset_inputs}


def test_every_stage_run_logs_its_real_inputs(tiny_run: Path) -> None:
    _, runs = _stage_runs(tiny_run)
    (ingest,) = runs["ingest"]
    assert "literary-source" in _inputs(ingest)
    (base,) = runs["build_base"]
    assert {"literary-train", "literary-validation"} <= set(_inputs(base))  # (no r1: ci_tiny's share is 0)
    for run in [*runs["train_loras"], *runs["lora"]]:  # the parent and each register's run
        found = _inputs(run)
        assert {"synthetic-r1-train", "literary-train"} <= set(found), run.info.run_name
        assert any(
            name.startswith("base ") and tags["mlflow.data.context"] == "base" for name, tags in found.items()
        )
    assert len(runs["lora"]) == 2
    (federate,) = runs["federate"]
    found = _inputs(federate)
    assert any(name.startswith("adapter ") for name in found) and any(
        name.startswith("base ") for name in found
    )
    pool = found["a2-pool"]  # aggregate only: the file's digest and the published noised count
    assert set(pool) == {"sha256", "path", "uploads_noised", "mlflow.data.context"}
    (dataset,) = [i.dataset for i in federate.inputs.dataset_inputs if i.dataset.name == "a2-pool"]
    assert not dataset.schema and not dataset.profile  # no columns, no row count: never its contents
    (publish,) = runs["publish"]
    found = _inputs(publish)
    manifest = json.loads((tiny_run / "releases" / "nimmerworld-base-v2" / "manifest.json").read_text())
    assert found["nimmerworld-base-v2 weights"]["sha256"] == manifest["weights_sha256"]
    assert any(name.startswith("federated adapter ") for name in found)
    assert sum(name.startswith("lora ") for name in found) >= 2


def test_federation_epsilon_curves_end_on_the_published_totals(tiny_run: Path) -> None:
    """Per round the cumulative epsilons, the totals at the last round's step: each history is
    non-decreasing in step and its last point is the federation's published total (the totals at
    step 0 had turned the curve V-shaped)."""
    client, runs = _stage_runs(tiny_run)
    (federate,) = runs["federate"]
    (adapter,) = (tiny_run / "artifacts" / "federated").glob("*/*")
    fed = read_metadata(adapter)["federation"]
    last = max(r["round"] for r in json.loads((adapter / results.ROUNDS).read_text()))
    for key in (A1, A2):
        history = client.get_metric_history(federate.info.run_id, key)
        history = sorted(history, key=lambda m: (m.step, m.timestamp))
        values = [m.value for m in history]
        assert history[0].step >= 1 and history[-1].step == last, key
        assert values == sorted(values), (key, [(m.step, m.value) for m in history])
        assert values[-1] == pytest.approx(fed[key])
        assert federate.data.metrics[key] == pytest.approx(fed[key])  # the UI's "latest" value
    loss = client.get_metric_history(federate.info.run_id, "heldout_loss")
    assert min(m.step for m in loss) == 0 and max(m.step for m in loss) == last


def test_versions_and_publish_run_name_both_epsilons(tiny_run: Path) -> None:
    client, runs = _stage_runs(tiny_run)
    manifest = json.loads((tiny_run / "releases" / "nimmerworld-base-v2" / "manifest.json").read_text())
    privacy = manifest["privacy"]
    (publish,) = runs["publish"]
    metrics = publish.data.metrics
    assert metrics[A1] == pytest.approx(privacy[A1]) and metrics[A2] == pytest.approx(privacy[A2])
    assert "epsilon" not in metrics and "differential_privacy_epsilon" not in metrics
    for mv in client.search_model_versions("name='nimmerworld-base'"):
        assert "epsilon" not in mv.tags and A1 in mv.tags and A2 in mv.tags
        assert not [v for v in mv.tags.values() if v.lstrip().startswith(("{", "["))], mv.tags
    (v2,) = [
        mv
        for mv in client.search_model_versions("name='nimmerworld-base'")
        if mv.tags["version_label"] == "nimmerworld-base-v2"
    ]
    assert v2.tags[A1] == f"{privacy[A1]:.3f}" and v2.tags[A2] == f"{privacy[A2]:.3f}"
    assert v2.tags["privacy_caveat.epsilon_a1_user_level"] == "NO MEANINGFUL GUARANTEE"  # ci_tiny: plumbing
