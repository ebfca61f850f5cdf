"""Exploit tests from an adversarial review of version loading (issue 21, item 6): the private
copy that ``load_model`` loads from must be made from at most the bytes that were signed, and a
file swapped after verification must fail, never fill the disk or hang the loader."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Any

import pytest

from nimmer_train.publish import versions
from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.publish.versions import VerifiedVersion, verified_copy

WEIGHTS = bytes(range(256)) * 64  # 16 KiB


def _verified(tmp_path: Path) -> VerifiedVersion:
    """A version as open_version returns it, its one file as signed (the copy needs no more)."""
    folder = tmp_path / "releases" / "nimmerworld-base-v1"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(WEIGHTS)
    row = {"path": "model.safetensors", "sha256": hashlib.sha256(WEIGHTS).hexdigest(), "size": len(WEIGHTS)}
    manifest = {"blob_distribution": {"files": [row]}}
    return VerifiedVersion("nimmerworld-base-v1", folder, manifest, {})


def test_the_copy_never_reads_past_the_signed_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After verification the weights are swapped for a 16 GiB sparse file (no disk space on the
    release side): the private copy read and wrote all of it before comparing the size, filling
    the disk under the loader's temporary folder."""
    version = _verified(tmp_path)
    weights = version.folder / "model.safetensors"
    with open(weights, "r+b") as fh:
        fh.truncate(2**34)
    written = [0]
    real_open = open

    class Counting:
        def __init__(self, fh: Any) -> None:
            self.fh = fh

        def write(self, data: bytes) -> int:
            written[0] += len(data)
            assert written[0] <= len(WEIGHTS) + 2**20, "the copy kept writing past the signed size"
            return self.fh.write(data)

        def __enter__(self) -> Counting:
            return self

        def __exit__(self, *exc: object) -> None:
            self.fh.close()

    def counting_open(path: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        fh = real_open(path, mode, *args, **kwargs)
        return Counting(fh) if "w" in mode else fh

    monkeypatch.setattr(versions, "open", counting_open, raising=False)
    with (
        pytest.raises(IntegrityError, match="model.safetensors changed after verification"),
        verified_copy(version),
    ):
        pass
    assert written[0] <= len(WEIGHTS) + 1


def test_a_file_swapped_for_a_fifo_fails_instead_of_hanging(tmp_path: Path) -> None:
    """A named pipe in place of a verified file: ``os.open`` blocked until some writer came,
    so the loader hung (O_NOFOLLOW does not refuse a FIFO)."""
    version = _verified(tmp_path)
    weights = version.folder / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    outcome: list[BaseException | None] = []

    def copy() -> None:
        try:
            with verified_copy(version):
                outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=copy, daemon=True)
    worker.start()
    worker.join(timeout=10)
    hung = worker.is_alive()
    if hung:  # release the blocked open() so the thread ends
        fd = os.open(weights, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(timeout=10)
    assert not hung, "verified_copy blocked opening a FIFO"
    assert len(outcome) == 1 and isinstance(outcome[0], IntegrityError), outcome
    assert "not a regular file" in str(outcome[0])
