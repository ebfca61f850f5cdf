"""Verification throughput of a published version: MB/s of ``verify_folder`` (signature check plus
sha256 of every file, as a player's loader runs it) against ``sha256sum`` of the same files, in the
same run, page cache warm for both. Ratio = ours / sha256sum (1.0: as fast as coreutils).

Also verifies the demo's v1 when ``releases/`` holds it (not in smoke mode).
python -m benchmarks.bench_publish [--smoke]      (all of them: make bench)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from nimmer_train.publish.manifest import FORMAT, SIGNATURE, manifest_bytes, release_files, verify_folder
from nimmer_train.publish.signing import Keyring, generate_key, load_private, sign, signature_bytes

REPO = Path(__file__).resolve().parents[1]
SIZES_MB = {"model.safetensors": 256, "tokenizer.json": 2, "config.json": 0.001}
SMOKE_SIZES_MB = {"model.safetensors": 2, "tokenizer.json": 0.5, "config.json": 0.001}


def make_version(root: Path, sizes_mb: dict[str, float]) -> tuple[Path, Keyring]:
    folder = root / "nimmerworld-base-v1"
    folder.mkdir()
    for name, mb in sizes_mb.items():
        with open(folder / name, "wb") as fh:
            for _ in range(max(1, int(mb))):
                fh.write(os.urandom(int(min(mb, 1) * 2**20)))
    key = root / "keys" / "publisher.key"
    generate_key(key, root / "keys" / "trusted")
    manifest = {"format": FORMAT, "blob_distribution": {"files": release_files(folder)}}
    raw = manifest_bytes(manifest)
    (folder / "manifest.json").write_bytes(raw)
    (folder / SIGNATURE).write_bytes(signature_bytes(sign(raw, load_private(key))))
    return folder, Keyring.load(root / "keys" / "trusted")


def measure(folder: Path, keyring: Keyring, repeats: int) -> dict[str, float]:
    files = [
        folder / f["path"]
        for f in json.loads((folder / "manifest.json").read_text())["blob_distribution"]["files"]
    ]
    mb = sum(p.stat().st_size for p in files) / 1e6
    ours, coreutils = [], []
    verify_folder(folder, keyring)  # warm the page cache
    for _ in range(repeats):
        start = time.perf_counter()
        verify_folder(folder, keyring)
        ours.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run(["sha256sum", *map(str, files)], check=True, capture_output=True)
        coreutils.append(time.perf_counter() - start)
    ours_mbs, core_mbs = mb / statistics.median(ours), mb / statistics.median(coreutils)
    return {
        "mb": round(mb, 1),
        "verify_mb_s": round(ours_mbs),
        "sha256sum_mb_s": round(core_mbs),
        "ratio": round(ours_mbs / core_mbs, 3),
    }


def run(smoke: bool = False) -> dict[str, object]:
    """verify_folder MB/s over sha256sum MB/s on a synthetic version (and the demo's v1 if any)."""
    repeats, sizes = (2, SMOKE_SIZES_MB) if smoke else (5, SIZES_MB)
    with tempfile.TemporaryDirectory() as tmp:
        folder, keyring = make_version(Path(tmp), sizes)
        synthetic = measure(folder, keyring, repeats)
    report: dict[str, object] = {
        "verify_over_sha256sum_ratio": synthetic["ratio"],
        "goal": "verify_folder about as fast as coreutils sha256sum on the same files (ratio >= 0.9)",
        "repeats": repeats,
        "synthetic": synthetic,
    }
    demo = REPO / "releases" / "nimmerworld-base-v1"
    if demo.is_dir() and not smoke:
        report["demo_v1"] = measure(demo, Keyring.load(REPO / "keys" / "trusted"), repeats)
    return report


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
