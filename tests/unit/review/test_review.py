"""The review library (nimmer_train.review) over a real MLflow SQLite store, a real published
version and a real player store; the notebook lint and the parameters injection."""

from __future__ import annotations

import json
from pathlib import Path

import mlflow
import nbformat
import pytest
from mlflow.tracking import MlflowClient

from nimmer_train import tracking
from nimmer_train.errors import NimmerError
from nimmer_train.review import federation, notebooks, registers, runs, versions
from nimmer_train.review import memory as review_memory
from nimmer_train.review.sources import sources

ROUNDS = [
    {"round": 1, "sampled": 4, "participants": 3, "dropped": 1, "rejected": ["c9"], "accepted": True,
     "heldout_loss": 6.1, "epsilon_a1_user_level": 2.0, "epsilon_a2_record_level": 1.0, "reason": ""},
    {"round": 2, "sampled": 4, "participants": 4, "dropped": 0, "rejected": [], "accepted": True,
     "heldout_loss": 5.9, "epsilon_a1_user_level": 3.5, "epsilon_a2_record_level": 1.4, "reason": ""},
]  # fmt: skip
CELL = {"loss": 5.0, "low": 4.9, "high": 5.1, "n": 3, "tokens": 30}
SUMMARY = {
    "registers": ["a", "b"],
    "headline": {"set": "r1", "tokens": "utterance"},
    "scores": {
        "r1": {
            "utterance": {
                "registers": ["a", "b"],
                "matrix": {
                    "a": {"base": CELL, "a": {**CELL, "loss": 4.0}, "b": CELL},
                    "b": {"base": CELL, "a": CELL, "b": {**CELL, "loss": 4.5}},
                },
                "separability": {"value": 0.8, "low": 0.6, "high": 1.0},
                "mean_gain": {"value": 0.75, "low": 0.5, "high": 1.0},
            }
        }
    },
}


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A workdir whose mlflow.db holds one run_all with the stages the notebooks read."""
    work = tmp_path_factory.mktemp("review")
    client = MlflowClient(f"sqlite:///{work / 'mlflow.db'}")
    exp = client.create_experiment("nimmer-run_all", artifact_location=(work / "mlartifacts").as_uri())

    def child(stage: str, parent: str | None, **tags: str) -> str:
        run = client.create_run(exp, run_name=f"{stage} · tiny", tags={"stage": stage, **tags})
        if parent:
            client.set_tag(run.info.run_id, "mlflow.parentRunId", parent)
        return run.info.run_id

    parent = child("run_all", None)
    base = child("build_base", parent, config_hash="c" * 64, output=str(work / "base"))
    for step, loss in enumerate([6.0, 5.5, 5.2]):
        client.log_metric(base, "train_loss", loss, step=step * 10)
    client.log_metric(base, "val_loss", 5.4, step=20)
    loras = child("train_loras", parent, base="tiny-1")
    client.log_dict(loras, SUMMARY, registers.SUMMARY)
    client.log_metric(loras, "margin.r1.utterance.a", 1.0)
    client.log_metric(loras, "margin.r1.utterance.a_low", 0.5)
    client.log_metric(loras, "margin.r1.utterance.a_high", 1.5)
    fed = child("federate", parent)
    client.log_param(fed, "federated.epsilon_budget", "None")
    client.log_param(fed, "federated.delta", "1e-05")
    client.log_dict(fed, ROUNDS, federation.ROUNDS)
    for run_id in (parent, base, loras, fed):
        client.set_terminated(run_id)
    return work


def test_sources_name_the_missing_store(tmp_path: Path) -> None:
    with pytest.raises(NimmerError, match=str(tmp_path / "mlflow.db")):
        sources(tmp_path)


def test_stages_in_order_with_fingerprints_and_outputs(store: Path) -> None:
    src = sources(store)
    parent = runs.last_run_all(src)
    table = runs.stages(src, parent)
    assert list(table["stage"]) == ["build_base", "train_loras", "federate"]
    row = table.iloc[0]
    assert row["fingerprint"] == "c" * 12 and row["output"] == str(store / "base")
    assert (table["seconds"] >= 0).all()
    curves = runs.base_curves(src, parent)
    assert list(curves["train_loss"].dropna()) == [6.0, 5.5, 5.2]
    assert curves["val_loss"].dropna().to_dict() == {20: 5.4}


def test_register_matrix_and_quality(store: Path) -> None:
    src = sources(store)
    run = runs.stage_run(src, runs.last_run_all(src), "train_loras")
    summary = registers.evaluation(src, run)
    matrix = registers.matrix(summary)
    assert matrix.loc["a", "a"] == 4.0 and matrix.loc["b", "b"] == 4.5 and matrix.loc["a", "base"] == 5.0
    head = registers.headline(summary).set_index("figure")
    assert head.loc["separability", "value"] == 0.8
    quality = registers.quality_by_version(src)
    assert quality.to_dict("records") == [
        {"run": "train_loras · tiny", "base": "tiny-1", "set": "r1", "tokens": "utterance",
         "register": "a", "margin": 1.0, "low": 0.5, "high": 1.5}
    ]  # fmt: skip
    assert registers.samples(src, run).empty  # no samples logged


def test_federation_rounds_and_budget(store: Path, tmp_path: Path) -> None:
    src = sources(store)
    run = runs.stage_run(src, runs.last_run_all(src), "federate")
    table = federation.rounds(src, run)
    assert list(table.index) == [1, 2]
    assert list(table["rejected"]) == [1, 0] and list(table["dropped"]) == [1, 0]
    assert list(table["epsilon_a1_user_level"]) == [2.0, 3.5]
    assert federation.budget(run) == {"epsilon_budget": None, "delta": 1e-05, "noise_multiplier": None}
    assert federation.privacy_utility(src) is None and federation.audits(src, tmp_path) is None
    record = {"ratios": {"audit_to_theory_ratio": 0.4}, "figures": {"dp_exposure_mean": 1.5, "list": [1]},
              "commit": "abc", "started_at": "2026-12-01T00:00:00+00:00"}  # fmt: skip
    (tmp_path / "bench_audit.json").write_text(json.dumps(record))
    table = federation.audits(src, tmp_path)
    assert dict(zip(table["figure"], table["value"], strict=True)) == {
        "audit_to_theory_ratio": 0.4,
        "dp_exposure_mean": 1.5,
    }


def test_metric_histories_become_artifacts(tmp_path: Path) -> None:
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri(uri)
    try:
        exp = mlflow.create_experiment("h", artifact_location=(tmp_path / "art").as_uri())
        with mlflow.start_run(experiment_id=exp) as run:
            for step in range(3):
                mlflow.log_metric("loss", 3.0 - step, step=step)
            mlflow.log_metric("tokens", 10)
            tracking.log_metric_histories(run.info.run_id)
    finally:
        mlflow.set_tracking_uri(previous)
    client = MlflowClient(uri)
    listed = {a.path for a in client.list_artifacts(run.info.run_id, "metrics")}
    assert listed == {tracking.HISTORY_CSV, tracking.CURVES_PNG}
    csv = mlflow.artifacts.download_artifacts(
        run_id=run.info.run_id, artifact_path=tracking.HISTORY_CSV, tracking_uri=uri
    )
    lines = Path(csv).read_text().splitlines()
    assert lines[0] == "metric,step,value,timestamp" and len(lines) == 5
    assert [line.split(",")[:3] for line in lines[1:4]] == [
        ["loss", "0", "3.0"],
        ["loss", "1", "2.0"],
        ["loss", "2", "1.0"],
    ]
    assert tracking.describe("lora drunk-scavenger").endswith("(drunk-scavenger)")


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.helpers.published import publish_registers

    root = tmp_path_factory.mktemp("published")
    publish_registers(root, ("drunk-scavenger",))
    return root


def test_versions_verify_and_diff(published: Path) -> None:
    src = sources(published, tracking_uri=f"sqlite:///{published / 'mlflow.db'}")
    table = versions.versions(src)
    assert list(table["version"]) == ["nimmerworld-base-v1"]
    checked = versions.verify(src)
    assert checked["ok"].all() and checked.loc[0, "files_checked"] > 0 and checked.loc[0, "loras_checked"] > 0
    assert versions.diff(src, "v1", "nimmerworld-base-v1").empty
    weights = published / "releases" / "nimmerworld-base-v1" / "model.safetensors"
    original = weights.read_bytes()
    try:
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        tampered = versions.verify(src)
        assert not tampered.loc[0, "ok"] and "model.safetensors" in tampered.loc[0, "error"]
    finally:
        weights.write_bytes(original)
    with pytest.raises(NimmerError, match="registry"):
        versions.versions(sources(published, "sqlite:///x.db", releases_dir=published / "none"))


def test_registered_models_carry_descriptions_and_aliases(published: Path) -> None:
    from nimmer_train.publish import mlflow_registry
    from nimmer_train.publish.registry import Registry

    uri = f"sqlite:///{published / 'mlflow.db'}"
    registry = Registry.open(published / "releases")
    try:
        with registry.writing():
            registry.set_alias("production", registry.find("v1"), "2026-01-01T00:00:00+00:00")
        mlflow_registry.sync(registry, uri)
    finally:
        registry.close()
    models = versions.registered_models(sources(published, uri)).set_index("model")
    assert models.loc["nimmerworld-base", "aliases"] == "candidate=v1, production=v1"  # publish: candidate
    assert models.loc["nimmerworld-lora-drunk-scavenger", "aliases"] == "candidate=v1, production=v1"
    assert models["description"].str.len().gt(0).all()
    (lora,) = MlflowClient(uri).search_model_versions("name = 'nimmerworld-lora-drunk-scavenger'")
    assert "nimmerworld-base-v1" in lora.description


CLASP_MARKER = "CLASP-MARKER-7f3a"


def test_player_review_reads_primary_never_clasp(tmp_path: Path) -> None:
    from nimmer_train.memory.player_memory import Mode, PlayerMemory
    from nimmer_train.memory.synthetic import generate_player
    from tests.helpers.memory import HashEmbedder

    player = tmp_path / "player"
    generate_player(player, HashEmbedder(), entries=40, player_id="pid-1", tier="A1_federated")
    memory = PlayerMemory(player, HashEmbedder())
    memory.write(f"whispered {CLASP_MARKER}", "npc", "working", "clasp", mode=Mode.IN_BETWEEN)
    memory.close()
    entries = review_memory.player_entries(player)
    summary = review_memory.player_summary(player)
    assert len(entries) == summary["entries"] > 0
    assert CLASP_MARKER not in entries.to_string() + json.dumps(summary)
    assert "clasp" not in summary["by_category"]
    curves = review_memory.importance_curves(entries, days=10)
    assert curves.shape[0] == 11 and (curves.iloc[0] >= curves.iloc[-1]).all()
    assert review_memory.find_player(tmp_path) is None  # not under players/ nor a federation


def test_agent_crystals_and_dreams(tmp_path: Path) -> None:
    from nimmer_train.agent.crystals import CrystalSpec
    from nimmer_train.memory.player_memory import Mode
    from tests.helpers.memory import agent_memory

    agent = agent_memory(tmp_path / "agent")
    first, second = agent.add(
        [CrystalSpec("the well is dry", "note"), CrystalSpec("the gate is shut", "note")]
    )
    agent.add([CrystalSpec(f"{CLASP_MARKER} secret", "note")], mode=Mode.IN_BETWEEN)
    agent.close()
    crystals = review_memory.agent_crystals(tmp_path / "agent")
    assert sorted(crystals["text"]) == ["the gate is shut", "the well is dry"]
    assert set(crystals["lifecycle"]) == {"generated"}
    assert review_memory.dream_insights(crystals).empty
    status = review_memory.agent_status(tmp_path / "agent")
    assert set(status["stores"]) == {"primary"}
    assert review_memory.agent_crystals(tmp_path / "nobody") is None


def _notebook(path: Path, outputs: bool) -> Path:
    nb = nbformat.v4.new_notebook(
        cells=[
            nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
            nbformat.v4.new_code_cell("x"),
        ]
    )
    if outputs:
        nb.cells[1].outputs = [
            nbformat.v4.new_output("execute_result", {"text/plain": "1"}, execution_count=1)
        ]
        nb.cells[1].execution_count = 1
    nbformat.write(nb, path)
    return path


def test_lint_fails_on_a_committed_output(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    clean, dirty = tmp_path / "clean", tmp_path / "dirty"
    clean.mkdir(), dirty.mkdir()
    _notebook(clean / "01_a.ipynb", outputs=False)
    _notebook(dirty / "01_a.ipynb", outputs=True)
    assert notebooks.main(["lint", str(clean)]) == 0
    assert notebooks.main(["lint", str(dirty)]) == 1
    assert "cell 1 has outputs" in capsys.readouterr().out
    assert all(not notebooks.committed_outputs(p) for p in notebooks.notebooks())  # the project's own


def test_parameters_are_injected_after_the_tagged_cell(tmp_path: Path) -> None:
    nb = nbformat.read(_notebook(tmp_path / "01_a.ipynb", outputs=False), as_version=4)
    notebooks.inject(nb, {"x": 2, "uri": None})
    assert nb.cells[1].source == "x = 2\nuri = None" and nb.cells[1].metadata["tags"] == [notebooks.INJECTED]
    nb.cells[0].metadata["tags"] = []
    with pytest.raises(NimmerError, match="parameters"):
        notebooks.inject(nb, {"x": 2})
