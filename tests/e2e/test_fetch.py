"""fetch_corpus against an HTTP server on loopback: ids -> URLs, sha256 verified, atomic files."""

from __future__ import annotations

import functools
import hashlib
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.helpers.pipelines import run_pipeline

WORKS = ("plato_apology", "sophocles_oedipus_trilogy")
IDS = {"plato_apology": 1656, "sophocles_oedipus_trilogy": 31}


@pytest.fixture
def mirror(tmp_path: Path, corpus_dir: Path) -> Iterator[tuple[str, Path]]:
    """A loopback server laid out like gutenberg.org's cache: /cache/epub/<id>/pg<id>.txt."""
    root = tmp_path / "www"
    for key, gid in IDS.items():
        folder = root / "cache/epub" / str(gid)
        folder.mkdir(parents=True)
        (folder / f"pg{gid}.txt").write_bytes((corpus_dir / f"{key}.txt").read_bytes())
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(root))
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", root
    server.shutdown()
    server.server_close()


def _overrides(base_url: str, dest: Path) -> list[str]:
    return [
        f"corpus.source_dir={dest}",
        f"corpus.include=[{','.join(WORKS)}]",
        # quoted: braces are Hydra override syntax
        f"corpus.fetch.url_template='{base_url}/cache/epub/{{gutenberg_id}}/pg{{gutenberg_id}}.txt'",
        "corpus.fetch.retries=0",
        *(f"corpus.works.{k}.url=null" for k in WORKS),
    ]


def test_fetch_downloads_and_verifies(mirror, tmp_path: Path, corpus_dir: Path) -> None:
    base_url, _ = mirror
    dest = tmp_path / "corpus"
    proc = run_pipeline("fetch_corpus", tmp_path, *_overrides(base_url, dest))
    assert "plato_apology: downloaded" in proc.stdout
    for key in WORKS:
        assert (dest / f"{key}.txt").read_bytes() == (corpus_dir / f"{key}.txt").read_bytes()
    again = run_pipeline("fetch_corpus", tmp_path, *_overrides(base_url, dest))
    assert "plato_apology: present" in again.stdout


def test_checksum_mismatch_keeps_nothing_and_names_the_file(mirror, tmp_path: Path) -> None:
    base_url, root = mirror
    tampered = root / "cache/epub/31/pg31.txt"
    tampered.write_bytes(tampered.read_bytes() + b"tampered")
    dest = tmp_path / "corpus"
    proc = run_pipeline("fetch_corpus", tmp_path, *_overrides(base_url, dest), check=False)
    assert proc.returncode == 1
    err = proc.stderr.strip().splitlines()[-1]
    assert "sophocles_oedipus_trilogy.txt: sha256" in err
    assert hashlib.sha256(tampered.read_bytes()).hexdigest() in err
    assert sorted(p.name for p in dest.iterdir()) == ["plato_apology.txt"]  # verified one kept


def test_unreachable_server_is_reported(tmp_path: Path) -> None:
    proc = run_pipeline(
        "fetch_corpus", tmp_path, *_overrides("http://127.0.0.1:9", tmp_path / "c"), check=False
    )
    assert proc.returncode == 1 and "download from http://127.0.0.1:9/" in proc.stderr
