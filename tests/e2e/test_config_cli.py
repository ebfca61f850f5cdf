"""Config mistakes as a user meets them: a pipeline launched with a bad key or a missing corpus
fails before any work, with one clear line and no traceback."""

from __future__ import annotations

import sqlite3
import subprocess
from pathlib import Path

import pytest

from tests.helpers.pipelines import run_pipeline

MissingCorpus = tuple[Path, subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def missing_corpus(tmp_path_factory: pytest.TempPathFactory) -> MissingCorpus:
    """(workdir, process) of one ``ingest`` pointed at a corpus folder that does not exist."""
    workdir = tmp_path_factory.mktemp("missing_corpus")
    return workdir, run_pipeline("ingest", workdir, f"corpus.source_dir={workdir}/none", check=False)


def test_cli_mistake_fails_before_work_without_traceback(tmp_path: Path) -> None:
    proc = run_pipeline("build_base", tmp_path, "model.hiden_size=3", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: config key 'model.hiden_size': Key 'hiden_size' not in "
        "'ModelConfig' (run with --cfg job to see the composed config)"
    )
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()


def test_cli_missing_corpus_is_one_clear_line(missing_corpus: MissingCorpus) -> None:
    _, proc = missing_corpus
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: corpus folder") and "pipelines.fetch_corpus" in last


def test_each_stage_has_its_own_job_name_help_and_log(tmp_path: Path, missing_corpus: MissingCorpus) -> None:
    # (no MLflow run: the job log is what is checked; tracking is tested with tiny_run)
    proc = run_pipeline("ingest", tmp_path, "corpus.include=[plato_apology]", "tracking.enabled=false")
    (log,) = (tmp_path / "outputs" / "ingest").glob("*/ingest.log")
    summary = next(line for line in proc.stdout.splitlines() if line.startswith("corpus: "))
    assert summary in log.read_text()  # the log holds what the stage printed, not only logging
    assert "corpus literary:" in log.read_text()
    assert not (tmp_path / "outputs" / "entry").exists()

    failed_workdir, failed = missing_corpus  # a failed stage's log holds its error line too
    assert failed.returncode == 1
    assert any(
        "error: corpus folder" in p.read_text()
        for p in (failed_workdir / "outputs" / "ingest").glob("*/ingest.log")
    )

    helped = run_pipeline("build_base", tmp_path, "--help")
    assert helped.stdout.startswith("Build the nimmerworld base")
    assert "build_base is powered by Hydra" in helped.stdout


def test_missing_inputs_fail_before_anything_is_written(tmp_path: Path) -> None:
    publish = run_pipeline("publish", tmp_path, "corpus.include=[plato_apology]", check=False)
    assert publish.returncode == 1 and "no corpus dataset at" in publish.stderr
    assert not (tmp_path / "keys").exists()  # no signing key made before the missing input failed

    loras = run_pipeline("train_loras", tmp_path, "corpus.include=[plato_apology]", check=False)
    assert loras.returncode == 1 and "no synthetic corpus at" in loras.stderr
    assert not (tmp_path / "artifacts").exists()  # the corpus was not built on the way to failing


def test_an_up_to_date_base_leaves_nothing_behind(tiny_run: Path) -> None:
    def runs() -> int:
        with sqlite3.connect(tiny_run / "mlflow.db") as db:
            return db.execute("select count(*) from runs").fetchone()[0]

    before = runs()
    proc = run_pipeline("build_base", tiny_run, "experiment=ci_tiny")
    assert "(reused)" in proc.stdout
    assert runs() == before  # no empty MLflow run
    assert not list((tiny_run / "artifacts" / "base").glob(".work-*"))
