"""The MLflow UI reads well: a real ``mlflow server`` process on loopback over the ci_tiny run's
store shows, through its REST API, one experiment per pipeline with a description, every run
with a readable name and a one-line description, the figures as artifacts (loss curves, the
register matrix, round records, model cards), and the registered models with descriptions and
the aliases candidate / production. Then what a reviewer sees, read from the DOM headless
Chromium renders (``--dump-dom`` after the React app ran): the experiment's runs table
(``?workflowType=machine_learning``, not the GenAI view) names every stage's run, the registered
model's page shows both epsilons (A.1 user-level, A.2 record-level) and no bare ``epsilon``, and
the publish run's page shows each version's sign-off.

Chromium: Debian's ``chromium`` package (``.ci/run`` installs it). Where it is missing the DOM
test fails when the environment variable ``CI`` is set (CI must run it) and is skipped elsewhere
(a developer's machine without a browser)."""

from __future__ import annotations

import json
import os
import re
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nimmer_train import tracking
from nimmer_train.publish import signoff
from nimmer_train.publish.registry import Registry
from tests.helpers.mlflow_server import chromium, mlflow_server, rendered_text, runs_table_url

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
        note = tags["mlflow.note.content"]  # publish's: its line, then each version's sign-off
        assert note == tracking.describe(stage) or (
            stage == "publish" and note.startswith(tracking.describe(stage))
        )
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
    tags = _tags(production["model_version"])  # one readable value per tag (docs/publishing.md)
    assert {"epsilon_a1_user_level", "epsilon_a2_record_level", "recipe.git_commit"} <= set(tags)
    assert "epsilon" not in tags and not any(v.lstrip().startswith("{") for v in tags.values())
    assert production["model_version"]["description"].startswith(production_label)
    lora = {a["alias"] for a in models["nimmerworld-lora-drunk-scavenger"]["aliases"]}
    assert lora == {"production", "candidate"}  # its LoRA fits both versions
    version = _get(server, "model-versions/get", name="nimmerworld-lora-drunk-scavenger", version="1")
    assert "trait-LoRA" in version["model_version"]["description"]


def _need_chromium() -> None:
    if chromium() is None:
        why = "Chromium is not installed (Debian: apt-get install chromium; .ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(f"{why}: CI must run the UI test")
        pytest.skip(why)


def test_the_runs_table_names_every_stages_run(server: str) -> None:
    _need_chromium()
    exp = _get(server, "experiments/get-by-name", experiment_name="nimmer-run_all")["experiment"]
    names = [
        r["info"]["run_name"]
        for r in _post(
            server, "runs/search", {"experiment_ids": [exp["experiment_id"]], "max_results": 1000}
        )["runs"]
    ]
    # the URL the demo prints (tracking.runs_url) opens the runs table (MLflow 3.17's default is its
    # GenAI view), every stage a row of its own (by start time the UI folds them under run_all)
    printed = runs_table_url(server, exp["experiment_id"])
    text = rendered_text(printed, lambda t: "Run Name" in t)
    assert "Run Name" in text and "run_all · tiny · ci_tiny" in text, text[:2000]
    assert "Welcome" not in text and "Traces 0" not in text
    # every run a row (sorted by name: the stages are not folded under run_all)
    table = rendered_text(printed, lambda t: all(n in t for n in names))
    for name in names:
        assert name in table, f"the runs table does not name {name!r}:\n{table[:3000]}"
    assert {n.split(" · ")[0] for n in names} >= STAGES


def test_the_model_page_shows_both_epsilons(server: str) -> None:
    _need_chromium()
    text = rendered_text(f"{server}/#/models/nimmerworld-base", lambda t: "Version 2" in t)
    assert "epsilon_a1_user_level" in text and "epsilon_a2_record_level" in text, text[:3000]
    # the page shows a version's tags as "key : value": no tag is a bare epsilon
    assert not re.search(r"(^| )epsilon : ", text), "a bare `epsilon` tag is on the model page"


def test_the_publish_run_page_shows_the_signoff(server: str, tiny_run: Path) -> None:
    _need_chromium()
    exp = _get(server, "experiments/get-by-name", experiment_name="nimmer-run_all")["experiment"]
    runs = _post(
        server, "runs/search", {"experiment_ids": [exp["experiment_id"]], "filter": "tags.stage = 'publish'"}
    )["runs"]
    run_id = runs[0]["info"]["run_id"]
    text = rendered_text(
        f"{server}/#/experiments/{exp['experiment_id']}/runs/{run_id}", lambda t: "Sign-off" in t
    )
    for label in ("nimmerworld-base-v2", "nimmerworld-base-v1"):
        verdict = signoff.verdict(signoff.signoff(tiny_run / "releases" / label))
        assert f"Sign-off: {label} {verdict}" in text, text[:3000]
    assert "epsilon: A.1 user-level" in text and "epsilon: A.2 record-level" in text
