"""The MLflow UI reads well: a real ``mlflow server`` process on loopback over the ci_tiny run's
store shows, through its REST API, one experiment per pipeline with a description, every run
with a readable name and a one-line description, the figures as artifacts (loss curves, the
register matrix, round records, model cards), and the registered models with descriptions and
the aliases candidate / production. Then headless Chromium screenshots of the experiment page
and a registered model's page, where Chromium is installed."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimmer_train import tracking
from nimmer_train.publish.registry import Registry
from tests.helpers.mlflow_server import chromium, mlflow_server, ui_screenshots

pytestmark = pytest.mark.slow

STAGES = {"run_all", "ingest", "synthesize", "build_base", "train_loras", "federate", "publish"}


@pytest.fixture(scope="module")
def server(tiny_run: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with mlflow_server(tiny_run, tmp_path_factory.mktemp("mlflow_ui") / "server.log") as url:
        yield url


def _get(url: str, endpoint: str, **query: Any) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}") as r:
        return json.load(r)


def _post(url: str, endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/api/2.0/mlflow/{endpoint}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request) as r:
        return json.load(r)


def _tags(entity: dict[str, Any]) -> dict[str, str]:
    return {t["key"]: t["value"] for t in entity.get("tags", [])}


def _artifacts(url: str, run_id: str, path: str = "") -> set[str]:
    return {f["path"] for f in _get(url, "artifacts/list", run_id=run_id, path=path).get("files", [])}


def test_experiments_and_runs_have_names_and_descriptions(server: str) -> None:
    experiments = _get(server, "experiments/search", max_results=100)["experiments"]
    (exp,) = [e for e in experiments if e["name"] == "nimmer-run_all"]
    assert _tags(exp)["mlflow.note.content"].startswith("Pipeline run_all: ")
    runs = _post(server, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 1000})[
        "runs"
    ]
    by_stage = {}
    for run in runs:
        tags, name = _tags(run["data"]), run["info"]["run_name"]
        stage = tags["stage"]
        assert name.startswith(f"{stage} · tiny · ci_tiny · "), name
        assert tags["mlflow.note.content"] == tracking.describe(stage)
        by_stage[stage] = run["info"]["run_id"]
    assert set(by_stage) >= STAGES
    assert {"lora hivemind-broadcast", "lora drunk-scavenger"} <= set(by_stage)
    # the figures a reviewer opens in the UI
    assert {tracking.CURVES_PNG, tracking.HISTORY_CSV} <= _artifacts(
        server, by_stage["build_base"], "metrics"
    )
    assert tracking.CURVES_PNG in _artifacts(server, by_stage["federate"], "metrics")
    assert "federation/rounds.json" in _artifacts(server, by_stage["federate"], "federation")
    assert "evaluation/heldout_loss_matrix.png" in _artifacts(server, by_stage["train_loras"], "evaluation")
    assert tracking.CURVES_PNG in _artifacts(server, by_stage["lora drunk-scavenger"], "metrics")
    assert "nimmerworld-base-v1/README.md" in _artifacts(server, by_stage["publish"], "nimmerworld-base-v1")
    assert "data_card/README.md" in _artifacts(server, by_stage["ingest"], "data_card")


def test_registered_models_have_descriptions_and_aliases(server: str, tiny_run: Path) -> None:
    models = {
        m["name"]: m for m in _get(server, "registered-models/search", max_results=100)["registered_models"]
    }
    assert {
        "nimmerworld-base",
        "nimmerworld-lora-hivemind-broadcast",
        "nimmerworld-lora-drunk-scavenger",
    } <= set(models)
    for model in models.values():
        assert model.get("description"), model["name"]
    aliases = {a["alias"]: a["version"] for a in models["nimmerworld-base"]["aliases"]}
    registry = Registry.open(tiny_run / "releases")  # the aliases follow the version registry's
    try:
        expected = {a: registry.find(a).row["mlflow_model_version"] for a in registry.aliases()}
        production_label = registry.find("production").label
    finally:
        registry.close()
    assert aliases == expected and set(aliases) == {"production", "candidate"}  # publish.promote_first
    production = _get(server, "registered-models/alias", name="nimmerworld-base", alias="production")
    assert {"epsilon", "corpus_refs", "recipe_ref"} <= set(_tags(production["model_version"]))
    assert production["model_version"]["description"].startswith(production_label)
    lora = {a["alias"] for a in models["nimmerworld-lora-drunk-scavenger"]["aliases"]}
    assert lora == {"production", "candidate"}  # its LoRA fits both versions
    version = _get(server, "model-versions/get", name="nimmerworld-lora-drunk-scavenger", version="1")
    assert "trait-LoRA" in version["model_version"]["description"]


def test_ui_screenshots(server: str, tmp_path: Path) -> None:
    if chromium() is None:
        pytest.skip("Chromium is not installed on this machine (Debian: apt-get install chromium)")
    exp = _get(server, "experiments/get-by-name", experiment_name="nimmer-run_all")["experiment"]
    for shot in ui_screenshots(server, exp["experiment_id"], "nimmerworld-base", tmp_path):
        assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000, shot
