"""The review notebooks (``notebooks/NN_*.ipynb``): executed with a real Jupyter kernel after a
papermill-style ``parameters`` cell, rendered to HTML, and linted (stored without outputs).

    python -m nimmer_train.review.notebooks lint notebooks
    python -m nimmer_train.review.notebooks render --workdir .     (what `make demo` runs)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from nimmer_train.errors import NimmerError

FOLDER = Path(__file__).resolve().parents[2] / "notebooks"
PARAMETERS, INJECTED = "parameters", "injected-parameters"
CELL_HANG_GUARD_S = 1800  # a guard against a hung kernel, never a bound on a slow machine
HTML_DIR = "outputs/review"


def notebooks(folder: Path = FOLDER) -> list[Path]:
    found = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not found:
        raise NimmerError(f"no review notebooks (NN_*.ipynb) in {folder}")
    return found


def inject(nb: Any, params: dict[str, Any]) -> Any:
    """Insert a cell after the one tagged ``parameters`` that sets ``params`` (as papermill does)."""
    import nbformat

    index = next(
        (i for i, c in enumerate(nb.cells) if PARAMETERS in c.get("metadata", {}).get("tags", [])), None
    )
    if index is None:
        raise NimmerError("the notebook has no cell tagged 'parameters' to override")
    source = "\n".join(f"{k} = {v!r}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": [INJECTED]})
    nb.cells.insert(index + 1, cell)
    return nb


def execute(path: Path, params: dict[str, Any], cwd: Path | None = None) -> Any:
    """Run every cell of ``path`` in a fresh python3 kernel; a failing cell raises
    ``nbclient.exceptions.CellExecutionError`` naming the cell and its traceback."""
    import nbformat
    from nbclient import NotebookClient

    nb = inject(nbformat.read(path, as_version=4), params)
    client = NotebookClient(
        nb,
        kernel_name="python3",
        timeout=CELL_HANG_GUARD_S,
        resources={"metadata": {"path": str(cwd or path.parent)}},
    )
    quiet = "ignore:IProgress not found"  # tqdm's notebook progress bars need ipywidgets
    warnings = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), quiet]))
    client.execute(env={**os.environ, "PYTHONWARNINGS": warnings})
    return nb


def to_html(nb: Any) -> str:
    from nbconvert import HTMLExporter

    body, _ = HTMLExporter().from_notebook_node(nb)
    return body


def render(out: Path, params: dict[str, Any], folder: Path = FOLDER) -> list[Path]:
    """Execute every notebook with ``params`` and write ``<out>/<name>.html``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for path in notebooks(folder):
        html = out / f"{path.stem}.html"
        tmp = html.with_suffix(".html.tmp")
        tmp.write_text(to_html(execute(path, params, cwd=out)))
        tmp.replace(html)
        written.append(html)
    return written


def committed_outputs(path: Path) -> list[str]:
    """What a stored notebook must not hold: cell outputs and execution counts."""
    try:
        cells = json.loads(path.read_text())["cells"]
    except (OSError, ValueError, KeyError) as exc:
        return [f"{path}: not a notebook ({exc})"]
    problems = []
    for i, cell in enumerate(cells):
        if cell.get("outputs"):
            problems.append(f"{path}: cell {i} has outputs")
        if cell.get("execution_count") is not None:
            problems.append(f"{path}: cell {i} has an execution count")
    return problems


def _lint(folders: list[Path]) -> int:
    problems = [p for folder in folders for nb in notebooks(folder) for p in committed_outputs(nb)]
    for line in problems:
        print(line)
    if problems:
        print("store notebooks without outputs: clear them (Jupyter: Edit > Clear Outputs of All Cells)")
    return 1 if problems else 0


def _render(args: argparse.Namespace) -> int:
    from nimmer_train import tracking
    from nimmer_train.config import TrackingConfig

    workdir = Path(args.workdir).resolve()
    store = TrackingConfig(
        uri=args.tracking_uri, store=str(workdir / "mlflow.db"), artifact_root=str(workdir / "mlartifacts")
    )
    params = {"workdir": str(workdir), "tracking_uri": args.tracking_uri, "releases_dir": args.releases_dir}
    started = time.monotonic()
    paths = render(Path(args.out).resolve() if args.out else workdir / HTML_DIR, params)
    print(f"\nReview notebooks (rendered in {time.monotonic() - started:.0f} s):")
    for path in paths:
        print(f"  {path}")
    print(f"Review the runs:\n  {tracking.ui_command(store)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nimmer_train.review.notebooks", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    lint = sub.add_parser("lint", help="fail when a stored notebook holds outputs")
    lint.add_argument("folders", nargs="*", type=Path, default=[FOLDER])
    render_cmd = sub.add_parser("render", help="execute the notebooks against a workdir, write HTML")
    render_cmd.add_argument("--workdir", default=".")
    render_cmd.add_argument("--tracking-uri", default=None)
    render_cmd.add_argument("--releases-dir", default=None)
    render_cmd.add_argument("--out", default=None, help=f"default: <workdir>/{HTML_DIR}")
    args = parser.parse_args(argv)
    try:
        return _lint(args.folders) if args.command == "lint" else _render(args)
    except NimmerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
