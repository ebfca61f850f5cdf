"""Download a corpus's works by their Project Gutenberg ids and verify each sha256.

A file is written under a temporary name and renamed only once its checksum matches, so the
corpus folder never holds a partial or unverified file. Works already present and intact are
left alone.
"""

from __future__ import annotations

import logging
import os
import random
import time
import urllib.error
import urllib.request
from pathlib import Path

from nimmer_train.artifacts import sha256_file
from nimmer_train.config import CorpusConfig, WorkConfig
from nimmer_train.errors import ConfigError, NimmerError

log = logging.getLogger(__name__)


def work_url(key: str, work: WorkConfig, corpus: CorpusConfig) -> str:
    if work.url:
        return work.url
    if work.gutenberg_id is None:
        raise ConfigError(f"corpus.works.{key}", "needs gutenberg_id or url to be fetched")
    return corpus.fetch.url_template.format(gutenberg_id=work.gutenberg_id)


def _download(url: str, dest: Path, timeout: float, retries: int) -> None:
    for attempt in range(retries + 1):
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(dest, "wb") as fh:
                while block := response.read(1 << 16):
                    fh.write(block)
                fh.flush()
                os.fsync(fh.fileno())
            return
        except urllib.error.HTTPError as exc:
            if exc.code < 500 or attempt == retries:
                raise
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            if attempt == retries:
                raise
        time.sleep(min(30.0, 2**attempt) * (0.5 + random.random() / 2))


def fetch_corpus(corpus: CorpusConfig) -> dict[str, str]:
    """Fetch every selected work into ``corpus.source_dir``; return key -> what happened."""
    folder = Path(corpus.source_dir).resolve()
    folder.mkdir(parents=True, exist_ok=True)
    outcome: dict[str, str] = {}
    failures: list[str] = []
    for key, work in corpus.selected_works().items():
        dest = folder / work.file
        if dest.is_file() and (work.sha256 is None or sha256_file(dest) == work.sha256):
            outcome[key] = "present"
            continue
        url = work_url(key, work, corpus)
        tmp = folder / f".{work.file}.part"
        try:
            _download(url, tmp, corpus.fetch.timeout_s, corpus.fetch.retries)
        except (urllib.error.URLError, OSError) as exc:
            failures.append(f"{work.file}: download from {url} failed ({exc})")
            tmp.unlink(missing_ok=True)
            continue
        got = sha256_file(tmp)
        if work.sha256 and got != work.sha256:
            tmp.unlink()
            failures.append(
                f"{work.file}: sha256 {got} from {url} does not match corpus.works.{key}.sha256 {work.sha256}"
            )
            continue
        tmp.replace(dest)
        outcome[key] = "downloaded"
        log.info("fetched %s from %s (sha256 ok)", dest, url)
    if failures:
        raise NimmerError(
            f"{len(failures)} of {len(outcome) + len(failures)} works not fetched "
            f"(verified ones were kept): " + "; ".join(failures)
        )
    return outcome
