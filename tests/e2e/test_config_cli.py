"""Config mistakes as a user meets them: a pipeline launched with a bad key or a missing corpus
fails before any work, with one clear line and no traceback."""

from __future__ import annotations

from pathlib import Path

from tests.helpers.pipelines import run_pipeline


def test_cli_mistake_fails_before_work_without_traceback(tmp_path: Path) -> None:
    proc = run_pipeline("build_base", tmp_path, "model.hiden_size=3", check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "error: config key 'model.hiden_size': Key 'hiden_size' not in "
        "'ModelConfig' (run with --cfg job to see the composed config)"
    )
    assert "Traceback" not in proc.stderr + proc.stdout
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "mlflow.db").exists()


def test_cli_missing_corpus_is_one_clear_line(tmp_path: Path) -> None:
    proc = run_pipeline("ingest", tmp_path, f"corpus.source_dir={tmp_path}/none", check=False)
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: corpus folder") and "pipelines.fetch_corpus" in last
