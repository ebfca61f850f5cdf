"""Ingest on the shared corpus (every cleaning quirk) and on bad input folders."""

from __future__ import annotations

import dataclasses
import logging
import re
from pathlib import Path

import pytest
import yaml
from datasets import load_from_disk

from nimmer_train.config import CorpusConfig, WorkConfig
from nimmer_train.corpus.ingest import ingest
from nimmer_train.errors import NimmerError
from tests.helpers import REPO

LICENCE_PHRASES = (
    "project gutenberg",
    "gutenberg-tm",
    "full license",
    "this ebook is for the use",
    "end of the project",
    "*** start of",
    "*** end of",
    "www.gutenberg",
)


def literary(source_dir: Path, **overrides) -> CorpusConfig:
    """The literary corpus config from conf/, pointed at ``source_dir``."""
    raw = yaml.safe_load((REPO / "conf/corpus/literary.yaml").read_text())
    raw["works"] = {k: WorkConfig(**v) for k, v in raw["works"].items()}
    raw["fetch"] = CorpusConfig().fetch
    raw.update(source_dir=str(source_dir), data_card=str(REPO / "data_cards/literary.md"), **overrides)
    return CorpusConfig(**raw)


@pytest.fixture(scope="module")
def full(tmp_path_factory: pytest.TempPathFactory, corpus_dir: Path):
    return ingest(literary(corpus_dir), tmp_path_factory.mktemp("artifacts"))


def test_no_gutenberg_or_licence_text_survives(full) -> None:
    ds = load_from_disk(str(full.dataset_dir))
    texts = [t.lower() for split in ds.values() for t in split["text"]]
    assert full.stats["works"] == 8 and len(texts) > 1000
    for phrase in LICENCE_PHRASES:
        assert not [t for t in texts if phrase in t], phrase


def test_proust_latin1_accents_decode(full) -> None:
    ds = load_from_disk(str(full.dataset_dir))
    proust = " ".join(r["text"] for r in ds["train"].to_list() if r["work"] == "proust_swanns_way")
    assert full.stats["per_work"]["proust_swanns_way"]["encoding"] == "latin-1"
    assert "Françoise" in proust and "Combray" in proust and "Méséglise" in proust
    assert not re.search("Ã.|\ufffd", proust)  # no mojibake, no replacement characters
    assert "\r" not in proust


def test_front_matter_rules_drop_introductions(full) -> None:
    ds = load_from_disk(str(full.dataset_dir))
    republic = [r for r in ds["train"].to_list() if r["work"] == "plato_republic"]
    assert republic[0]["text"].startswith("PERSONS OF THE DIALOGUE")
    assert not any("INTRODUCTION AND ANALYSIS" in r["text"] for r in republic)


def test_split_is_contiguous_per_work_and_leak_free(full) -> None:
    ds = load_from_disk(str(full.dataset_dir))
    train, val = ds["train"].to_list(), ds["validation"].to_list()
    train_texts = {r["text"] for r in train}
    for work in {r["work"] for r in val}:
        order = [r["chunk_index"] for r in val if r["work"] == work]
        train_idx = [r["chunk_index"] for r in train if r["work"] == work]
        assert order, work
        assert not [i for i in train_idx if min(order) <= i <= max(order)], work  # one section
    assert not [r for r in val if r["text"] in train_texts]


def test_chunks_carry_metadata(full) -> None:
    row = load_from_disk(str(full.dataset_dir))["train"][0]
    assert set(row) >= {"text", "work", "author", "translator", "source_sha256", "license", "trait_affinity"}
    proust = next(
        r
        for r in load_from_disk(str(full.dataset_dir))["train"].to_list()
        if r["work"] == "proust_swanns_way"
    )
    assert proust["trait_affinity"] == ["Mnemosyne"]
    assert proust["translator"] == "C. K. Scott Moncrieff"
    assert proust["source_sha256"] == "bd53d3258776a2c206f4586de5cf31b99fd8ef5b79a61e8c6bb8750b9bb4dec6"


def test_data_card_has_metadata_sections_and_figures(full) -> None:
    card = (full.path / "README.md").read_text()
    meta = yaml.safe_load(card.split("---\n")[1])
    for key in (
        "license",
        "language",
        "size_categories",
        "task_categories",
        "source_datasets",
        "pretty_name",
    ):
        assert key in meta, key
    assert meta["size_categories"] == ["1K<n<10K"]
    for section in (
        "Motivation",
        "Composition",
        "Collection process",
        "Preprocessing",
        "Uses",
        "Distribution",
        "Maintenance",
    ):
        assert f"## {section}" in card
    assert "<!-- figures" not in card
    assert str(full.stats["chunks"]) in card and "bd53d3258776" in card


def test_rerun_with_nothing_changed_does_no_work(full, corpus_dir: Path) -> None:
    mtime = (full.path / "manifest.json").stat().st_mtime_ns
    again = ingest(literary(corpus_dir), full.path.parent.parent)
    assert again.reused and again.path == full.path
    assert (full.path / "manifest.json").stat().st_mtime_ns == mtime
    changed = ingest(literary(corpus_dir, chunk_chars=1500), full.path.parent.parent)
    assert changed.path != full.path and not changed.reused


def _tiny_corpus(folder: Path, files: dict[str, bytes]) -> CorpusConfig:
    folder.mkdir(parents=True, exist_ok=True)
    works = {}
    for name, raw in files.items():
        (folder / name).write_bytes(raw)
        works[name.split(".")[0]] = WorkConfig(file=name, title=name, author="Anon")
    return CorpusConfig(
        name="tiny",
        source_dir=str(folder),
        works=works,
        chunk_chars=400,
        min_chunk_chars=50,
        data_card=str(folder / "no-card.md"),
    )


PROSE = ("It was a bright cold day in the city, and the clocks were striking. " * 4 + "\n\n") * 30


def test_bad_files_are_skipped_with_named_warnings_when_partial_is_allowed(tmp_path: Path, caplog) -> None:
    corpus = _tiny_corpus(
        tmp_path / "src",
        {
            "good.txt": PROSE.encode(),
            "empty.txt": b"",
            "image.txt": b"\x89PNG\x00\x00\x01",
            "cp1252.txt": ("\u201cHello\u201d said the caf\u00e9 owner. " * 40 + "\n\n").encode("cp1252"),
        },
    )
    absent = WorkConfig(file="absent.txt", title="a", author="b")
    corpus = dataclasses.replace(corpus, works={**corpus.works, "absent": absent}, allow_partial=True)
    with caplog.at_level(logging.WARNING):
        result = ingest(corpus, tmp_path / "artifacts")
    assert set(result.stats["skipped"]) == {"empty", "image", "absent"}
    log = caplog.text
    assert "empty.txt" in log and "empty file" in log
    assert "image.txt" in log and "binary" in log
    assert "absent.txt" in log and "not found" in log
    assert result.stats["per_work"]["cp1252"]["encoding"] == "cp1252"
    assert result.stats["duplicates_removed"]["exact"] > 0  # the repeated paragraphs


def test_a_missing_or_altered_work_fails_naming_the_file_the_hashes_and_the_fix(tmp_path: Path) -> None:
    corpus = _tiny_corpus(tmp_path / "src", {"good.txt": PROSE.encode(), "other.txt": PROSE[::-1].encode()})
    pinned = dataclasses.replace(corpus.works["other"], sha256="0" * 64)
    altered = dataclasses.replace(corpus, works={**corpus.works, "other": pinned})
    with pytest.raises(NimmerError) as exc:
        ingest(altered, tmp_path / "artifacts")
    message = str(exc.value)
    assert "corpus work other:" in message and str(tmp_path / "src" / "other.txt") in message
    assert f"expects {'0' * 64}" in message and "has sha256 " in message
    assert "pipelines.fetch_corpus corpus.include=[other]" in message and "allow_partial" in message
    absent = dataclasses.replace(
        corpus, works={**corpus.works, "gone": WorkConfig(file="gone.txt", title="g", author="h")}
    )
    with pytest.raises(NimmerError, match=r"corpus work gone: file .*gone.txt not found"):
        ingest(absent, tmp_path / "artifacts")
    assert not (tmp_path / "artifacts").exists()  # nothing written before failing


def test_no_usable_text_fails_clearly(tmp_path: Path) -> None:
    corpus = _tiny_corpus(tmp_path / "src", {"empty.txt": b"", "blob.txt": b"\x00\x01\x02"})
    corpus = dataclasses.replace(corpus, allow_partial=True)
    with pytest.raises(NimmerError, match="no usable text in .*empty.txt: empty file"):
        ingest(corpus, tmp_path / "artifacts")
    assert not (tmp_path / "artifacts" / "corpus").exists() or not any(
        (tmp_path / "artifacts" / "corpus").iterdir()
    )


def test_missing_folder_names_it_and_how_to_get_it(tmp_path: Path) -> None:
    corpus = _tiny_corpus(tmp_path / "src", {"a.txt": PROSE.encode()})
    corpus = dataclasses.replace(corpus, source_dir=str(tmp_path / "nowhere"))
    with pytest.raises(NimmerError, match=r"nowhere does not exist.*pipelines.fetch_corpus"):
        ingest(corpus, tmp_path / "artifacts")
