"""Artifacts on disk: content hashes, input fingerprints, atomic publication, manifests.

Every stage output is a folder named by a fingerprint of its inputs and config. It is built in a
hidden staging folder beside its final place, fsynced, and renamed into place, so a half-written
artifact is never visible. Its ``manifest.json`` lists the sha256 and size of every file.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import ModuleType
from typing import Any

MANIFEST = "manifest.json"
README = "README.md"  # an artifact's card: the data card of a dataset, the model card of a version
REPO_ROOT = Path(__file__).resolve().parent.parent  # the checkout: conf/, data_cards/, its git commit
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


FRESH_START = "fresh_start"  # an adapter's metadata / merged_adapter key: a fresh adapter's spec


def merged_voice(merged: dict[str, Any] | None) -> str | None:
    """The register whose voice a merged adapter carries: a version's ``merged_adapter`` entry or
    the adapter's metadata. None when nothing is merged, or when the adapter is a fresh one the
    population trained (``fresh_start``: the base's change, so that register keeps its LoRA)."""
    if not merged or merged.get(FRESH_START):
        return None
    return merged.get("register")


def sha256_file(path: Path, block: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(obj: Any) -> str:
    """Full sha256 of a JSON-serialisable object (keys sorted); stable across runs."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def source_fingerprint(*modules: ModuleType) -> str:
    """sha256 over the source files of ``modules``: a code change renames the artifacts it makes."""
    digest = hashlib.sha256()
    for module in modules:
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()


# --- where each kind of artifact lives under the artifacts root (cfg.paths.artifacts_dir()) -------


def artifact_name(name: str, fp: str) -> str:
    """An artifact folder's name: what it holds and the first 12 hex digits of its fingerprint."""
    return f"{name}-{fp[:12]}"


def corpus_path(artifacts: Path, corpus: str, fp: str) -> Path:
    """An ingested corpus dataset: ``corpus/<corpus>-<fp>``."""
    return artifacts / "corpus" / artifact_name(corpus, fp)


def synth_path(artifacts: Path, spec: str, fp: str) -> Path:
    """A synthetic corpus: ``synth/<composition spec>-<fp>`` (``spec="*"``: a glob of any spec)."""
    return artifacts / "synth" / artifact_name(spec, fp)


def pretrained_path(artifacts: Path, model: str, fp: str) -> Path:
    """A pretrained checkpoint converted once (from GGUF): ``pretrained/<model>-<fp>``."""
    return artifacts / "pretrained" / artifact_name(model, fp)


def base_path(artifacts: Path, label: str) -> Path:
    """A built base: ``base/<label>``, its label ``<model>-<fp>`` (:func:`artifact_name`)."""
    return artifacts / "base" / label


def loras_path(artifacts: Path, base: str = "") -> Path:
    """The register LoRAs trained on the base labelled ``base``: ``loras/<base>/``; without a
    base, the folder of every base's."""
    return artifacts / "loras" / base if base else artifacts / "loras"


def lora_path(artifacts: Path, base: str, register: str, fp: str) -> Path:
    """One register's LoRA trained on the base labelled ``base``: ``loras/<base>/<register>-<fp>``."""
    return loras_path(artifacts, base) / artifact_name(register, fp)


def rebased_lora_path(artifacts: Path, base: str, register: str, fp: str) -> Path:
    """A LoRA retrained on a newer base for publish's rebase, beside train_loras' own:
    ``rebase/loras/<base>/<register>-<fp>``."""
    return artifacts / "rebase" / "loras" / base / artifact_name(register, fp)


def federated_path(artifacts: Path, base: str, register: str, fp: str) -> Path:
    """A register's LoRA after federated rounds on the base labelled ``base``:
    ``federated/<base>/<register>-<fp>``."""
    return artifacts / "federated" / base / artifact_name(register, fp)


def merged_path(artifacts: Path, base: str, fp: str) -> Path:
    """A base with an adapter merged into its weights, staged for publish: ``merged/<base>-<fp>``."""
    return artifacts / "merged" / artifact_name(base, fp)


def git_commit(cwd: Path | None = REPO_ROOT) -> str:
    """The current commit, with ``-dirty`` when the work tree has changes; ``unknown`` outside git."""
    try:
        run = lambda *a: subprocess.run(  # noqa: E731
            ["git", *a], cwd=cwd, capture_output=True, text=True, check=True
        ).stdout.strip()
        commit = run("rev-parse", "HEAD")
        dirty = run("status", "--porcelain", "--untracked-files=no")
        return f"{commit}-dirty" if dirty else commit
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def fsync_dir(folder: Path) -> None:
    """Make a rename or unlink in ``folder`` durable."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
    for path in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(path)


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a staging folder; on success fsync it and rename it to ``final`` in one step.

    On failure the staging folder is removed and ``final`` is untouched.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    staging = final.parent / f".{final.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        fsync_tree(staging)
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
        fsync_dir(final.parent)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_bytes_atomic(path: Path, data: bytes, private: bool = False) -> None:
    """Write ``data`` to ``path`` through a temp file, fsync, rename and fsync the folder;
    ``private``: readable by the owner only (0600 from the first byte, see :func:`write_secret`).
    A failed write leaves ``path`` as it was and no temp file behind (a killed one leaves
    ``.NAME.tmp-*``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_via_temp(path, data, private, overwrite=True)


def write_secret(path: Path, data: bytes, overwrite: bool = False) -> None:
    """Write a secret (a private key, a sealing secret) that no one else can read and no reader
    sees half-written: a fresh temp file beside ``path``, 0600 before its first byte whatever the
    umask, fsynced, then put in place in one step. A key is never overwritten unless
    ``overwrite``: FileExistsError when ``path`` exists (a symlink there included) and the temp is
    removed. A kill leaves at most a ``.NAME.tmp-*`` file, never a partial ``path``."""
    _write_via_temp(path, data, private=True, overwrite=overwrite)


def _write_via_temp(path: Path, data: bytes, private: bool, overwrite: bool) -> None:
    """The temp is created exclusively and never through a symlink (O_EXCL | O_NOFOLLOW) under a
    name no one can guess in advance; ``overwrite`` renames it over ``path``, else it is linked
    (``os.link`` refuses an existing name atomically) and its temp name unlinked."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | NOFOLLOW, 0o600 if private else 0o666)
    try:
        with os.fdopen(fd, "wb") as fh:
            if private:
                os.fchmod(fh.fileno(), 0o600)  # whatever the umask: 0600 before the first byte
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            os.link(tmp, path, follow_symlinks=False)
    finally:
        tmp.unlink(missing_ok=True)  # gone already after a rename; the second name after a link
    fsync_dir(path.parent)


def write_json_atomic(path: Path, obj: Any, private: bool = False) -> None:
    """Write JSON to ``path`` atomically (:func:`write_bytes_atomic`)."""
    text = json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n"
    write_bytes_atomic(path, text.encode(), private)


def file_table(folder: Path) -> list[dict[str, Any]]:
    """sha256 and size of every file under ``folder`` except the manifest, sorted by path."""
    rows = []
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST):
        rows.append(
            {
                "path": path.relative_to(folder).as_posix(),
                "sha256": sha256_file(path),
                "size": path.stat().st_size,
            }
        )
    return rows


def write_manifest(folder: Path, kind: str, fingerprint_: str, lineage: dict[str, Any]) -> dict:
    """Write ``manifest.json`` for a finished artifact folder and return it."""
    manifest = {
        "kind": kind,
        "fingerprint": fingerprint_,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "lineage": lineage,
        "files": file_table(folder),
    }
    write_json_atomic(folder / MANIFEST, manifest)
    return manifest


def read_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / MANIFEST).read_text())


def intact_manifest(folder: Path) -> dict[str, Any] | None:
    """The manifest of a published folder whose files all match it, else None."""
    if (folder / MANIFEST).exists() and not verify_manifest(folder):
        return read_manifest(folder)
    return None


def verify_manifest(folder: Path) -> list[str]:
    """Files whose bytes no longer match the manifest (empty when the folder is intact)."""
    expected = {row["path"]: row["sha256"] for row in read_manifest(folder)["files"]}
    actual = {row["path"]: row["sha256"] for row in file_table(folder)}
    return sorted(p for p in expected.keys() | actual.keys() if expected.get(p) != actual.get(p))
