"""Literary corpus ingest: files -> clean chunks -> deduplicated train/validation DatasetDict.

The output folder ``artifacts/corpus/<name>-<fingerprint>`` holds ``dataset/`` (HF
``save_to_disk``), the data card ``README.md``, ``stats.json`` and ``manifest.json``. The
fingerprint covers the source bytes, the corpus config and the ingest version, so a re-run with
nothing changed finds the folder and does no work.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict, load_from_disk

from nimmer_train.artifacts import (
    README,
    atomic_dir,
    corpus_path,
    fingerprint,
    intact_manifest,
    sha256_file,
    source_fingerprint,
    write_json_atomic,
    write_manifest,
)
from nimmer_train.config import CorpusConfig, WorkConfig
from nimmer_train.corpus import data_card
from nimmer_train.corpus.chunking import chunk_paragraphs, contiguous_validation
from nimmer_train.corpus.cleaning import UnusableFile, clean
from nimmer_train.corpus.dedup import find_duplicates
from nimmer_train.errors import ConfigError, NimmerError

log = logging.getLogger(__name__)

INGEST_VERSION = 1
_TOKEN = re.compile(r"\w+|[^\w\s]")


@dataclass(frozen=True)
class IngestResult:
    path: Path
    fingerprint: str
    stats: dict[str, Any]
    reused: bool

    @property
    def dataset_dir(self) -> Path:
        return self.path / "dataset"


def count_tokens(text: str) -> int:
    """Word-level tokens (regex ``\\w+|[^\\w\\s]``): the corpus size before any BPE exists."""
    return len(_TOKEN.findall(text))


def corpus_folder(corpus: CorpusConfig) -> Path:
    """The corpus folder; a clear error when it is absent."""
    folder = Path(corpus.source_dir).resolve()
    if not folder.is_dir():
        raise NimmerError(
            f"corpus folder {folder} does not exist (corpus.source_dir). Download it with "
            f"`python -m pipelines.fetch_corpus corpus.source_dir={folder}`, or point "
            "corpus.source_dir at a folder of plain-text works."
        )
    return folder


def source_files(corpus: CorpusConfig) -> dict[str, tuple[Path, str | None]]:
    """(path, sha256 or None when missing) for each selected work; fails if the folder is absent."""
    folder = corpus_folder(corpus)
    out = {}
    for key, work in corpus.selected_works().items():
        path = folder / work.file
        out[key] = (path, sha256_file(path) if path.is_file() else None)
    return out


def corpus_fingerprint(corpus: CorpusConfig, sources: dict[str, tuple[Path, str | None]]) -> str:
    settings = dataclasses.asdict(corpus)
    for key in ("source_dir", "data_card", "fetch"):
        settings.pop(key)
    from nimmer_train.corpus import chunking, cleaning, dedup

    code = source_fingerprint(chunking, cleaning, dedup, sys.modules[__name__])
    return fingerprint(
        {
            "version": INGEST_VERSION,
            "code": code,
            "corpus": settings,
            "sources": {k: sha for k, (_, sha) in sources.items()},
        }
    )


def _locate(
    corpus: CorpusConfig, artifacts: Path
) -> tuple[dict[str, tuple[Path, str | None]], str, Path, IngestResult | None]:
    """(sources, fingerprint, folder, the published dataset there or None) for ``corpus``."""
    sources = source_files(corpus)
    fp = corpus_fingerprint(corpus, sources)
    out = corpus_path(artifacts, corpus.name, fp)
    manifest = intact_manifest(out)
    found = IngestResult(out, fp, manifest["lineage"]["stats"], reused=True) if manifest else None
    return sources, fp, out, found


def find_corpus(corpus: CorpusConfig, artifacts: Path) -> IngestResult:
    """The already-built corpus dataset for ``corpus``; a clear error when there is none."""
    _, _, out, found = _locate(corpus, artifacts)
    if found is None:
        raise NimmerError(
            f"no corpus dataset at {out}: run `python -m pipelines.ingest` with the same overrides first"
        )
    return found


def ingest(corpus: CorpusConfig, artifacts: Path) -> IngestResult:
    """Build (or find) the corpus dataset for ``corpus`` under ``artifacts``."""
    sources, fp, out, found = _locate(corpus, artifacts)
    if found is not None:
        log.info("corpus %s is up to date at %s; nothing to do", corpus.name, out)
        return found

    rows, per_work, skipped = _read_works(corpus, sources)
    if not rows:
        raise NimmerError(
            f"no usable text in {Path(corpus.source_dir).resolve()}: every file was skipped "
            f"({'; '.join(f'{k}: {why}' for k, why in skipped.items()) or 'no works selected'})"
        )
    exact, near = find_duplicates(
        [r["text"] for r in rows], corpus.near_dup_threshold, corpus.shingle_words, corpus.minhash_perms
    )
    kept = [r for i, r in enumerate(rows) if i not in exact and i not in near]
    train, validation = _split(kept, corpus.validation_fraction)
    stats = _stats(train, validation, per_work, skipped, len(exact), len(near))

    with atomic_dir(out) as staging:
        columns = list(rows[0])
        DatasetDict(
            {
                "train": Dataset.from_dict({c: [r[c] for r in train] for c in columns}),
                "validation": Dataset.from_dict({c: [r[c] for r in validation] for c in columns}),
            }
        ).save_to_disk(str(staging / "dataset"))
        write_json_atomic(staging / "stats.json", stats)
        (staging / README).write_text(_card(corpus, stats))
        write_manifest(
            staging,
            "corpus",
            fp,
            {"corpus": corpus.name, "stats": stats, "sources": {k: s for k, (_, s) in sources.items()}},
        )
    log.info(
        "corpus %s: %d train / %d validation chunks at %s", corpus.name, len(train), len(validation), out
    )
    return IngestResult(out, fp, stats, reused=False)


def load(result: IngestResult) -> DatasetDict:
    return load_from_disk(str(result.dataset_dir))


def _read_works(
    corpus: CorpusConfig, sources: dict[str, tuple[Path, str | None]]
) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]], dict[str, str]]:
    rows: list[dict[str, Any]] = []
    per_work: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    for key, work in corpus.selected_works().items():
        path, sha = sources[key]
        if sha is None:
            skipped[key] = _unusable(corpus, key, f"file {path} not found")
            continue
        if work.sha256 and work.sha256 != sha:
            skipped[key] = _unusable(
                corpus, key, f"{path} has sha256 {sha}, but corpus.works.{key}.sha256 expects {work.sha256}"
            )
            continue
        try:
            text = clean(path.read_bytes(), work.drop_before, work.drop_after)
        except UnusableFile as exc:
            skipped[key] = _unusable(corpus, key, f"{path}: {exc.reason}")
            continue
        except ValueError as exc:  # a drop rule that matches nothing is a config mistake
            field = "drop_before" if "drop_before" in str(exc) else "drop_after"
            raise ConfigError(f"corpus.works.{key}.{field}", f"{exc} in {path}") from exc
        if not text.gutenberg_markers:
            log.warning("%s: no Project Gutenberg markers found; kept the whole file", path)
        chunks = chunk_paragraphs(text.text.split("\n\n"), corpus.chunk_chars, corpus.min_chunk_chars)
        per_work[key] = {
            "encoding": text.encoding,
            "sha256": sha,
            "file": work.file,
            "boilerplate_paragraphs_dropped": text.boilerplate_paragraphs_dropped,
        }
        rows += [_row(key, work, path, sha, text.encoding, i, c) for i, c in enumerate(chunks)]
    return rows, per_work, skipped


def _unusable(corpus: CorpusConfig, key: str, problem: str) -> str:
    """A selected work that cannot be used: an error, or (``corpus.allow_partial``) a warning."""
    if not corpus.allow_partial:
        raise NimmerError(
            f"corpus work {key}: {problem}. Fetch it again with `python -m pipelines.fetch_corpus "
            f"corpus.include=[{key}]`, leave it out with corpus.include, or build without it with "
            "corpus.allow_partial=true"
        )
    log.warning("skipping %s (corpus.allow_partial): %s", key, problem)
    return problem


def _row(key: str, work: WorkConfig, path: Path, sha: str, encoding: str, i: int, text: str) -> dict:
    return {
        "text": text,
        "work": key,
        "title": work.title,
        "author": work.author,
        "translator": work.translator or "",
        "license": work.license,
        "trait_affinity": list(work.trait_affinity),
        "source_file": path.name,
        "source_sha256": sha,
        "encoding": encoding,
        "chunk_index": i,
    }


def _split(rows: list[dict[str, Any]], fraction: float) -> tuple[list[dict], list[dict]]:
    """One contiguous validation section per work, placed by a seed derived from the work key."""
    train: list[dict] = []
    validation: list[dict] = []
    works = sorted({r["work"] for r in rows})
    for work in works:
        chunks = [r for r in rows if r["work"] == work]
        section = contiguous_validation(len(chunks), fraction, zlib.crc32(work.encode()))
        for i, row in enumerate(chunks):
            (validation if i in section else train).append(row)
    return train, validation


def _stats(
    train: list[dict], validation: list[dict], per_work: dict[str, dict], skipped: dict, exact: int, near: int
) -> dict[str, Any]:
    for work, info in per_work.items():
        for split, rows in (("train", train), ("validation", validation)):
            mine = [r for r in rows if r["work"] == work]
            info[f"{split}_chunks"] = len(mine)
            info[f"{split}_tokens"] = sum(count_tokens(r["text"]) for r in mine)
            info[f"{split}_chars"] = sum(len(r["text"]) for r in mine)
    return {
        "works": len(per_work),
        "chunks": len(train) + len(validation),
        "tokens": sum(i["train_tokens"] + i["validation_tokens"] for i in per_work.values()),
        "token_unit": "word-level regex tokens \\w+|[^\\w\\s]",
        "splits": {"train": len(train), "validation": len(validation)},
        "duplicates_removed": {"exact": exact, "near": near},
        "skipped": skipped,
        "per_work": per_work,
    }


def _card(corpus: CorpusConfig, stats: dict[str, Any]) -> str:
    per_work = stats["per_work"]
    works = corpus.works
    figures = {
        "composition": data_card.table(
            [
                {
                    "works": stats["works"],
                    "chunks": stats["chunks"],
                    "tokens (word-level)": stats["tokens"],
                    "train chunks": stats["splits"]["train"],
                    "validation chunks": stats["splits"]["validation"],
                }
            ]
        ),
        "per_work": data_card.table(
            [
                {
                    "work": works[k].title,
                    "author": works[k].author,
                    "translator": works[k].translator or "",
                    "trait affinity": ", ".join(works[k].trait_affinity),
                    "train chunks": v["train_chunks"],
                    "validation chunks": v["validation_chunks"],
                    "tokens": v["train_tokens"] + v["validation_tokens"],
                }
                for k, v in per_work.items()
            ]
        ),
        "sources": data_card.table(
            [
                {
                    "file": v["file"],
                    "encoding": v["encoding"],
                    "sha256": f"`{v['sha256']}`",
                    "licence": works[k].license,
                }
                for k, v in per_work.items()
            ]
        ),
        "preprocessing": data_card.table(
            [
                {
                    "exact duplicates removed": stats["duplicates_removed"]["exact"],
                    "near duplicates removed": stats["duplicates_removed"]["near"],
                    "boilerplate paragraphs dropped": sum(
                        v["boilerplate_paragraphs_dropped"] for v in per_work.values()
                    ),
                    "files skipped": len(stats["skipped"]),
                }
            ]
        )
        + "".join(f"\n\nSkipped `{k}`: {why}" for k, why in stats["skipped"].items()),
    }
    metadata = {
        "size_categories": [data_card.size_category(stats["chunks"])],
        "dataset_info": {"splits": [{"name": s, "num_examples": n} for s, n in stats["splits"].items()]},
    }
    return data_card.render(Path(corpus.data_card), metadata, figures)
