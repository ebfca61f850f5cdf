"""Chunking, contiguous splits and duplicate detection."""

from nimmer_train.corpus.chunking import chunk_paragraphs, contiguous_validation
from nimmer_train.corpus.dedup import find_duplicates


def test_chunks_respect_paragraphs_and_size() -> None:
    paras = [f"Paragraph {i} " + "word " * 40 for i in range(30)]
    chunks = chunk_paragraphs(paras, max_chars=600, min_chars=100)
    assert all(len(c) <= 600 for c in chunks)
    assert "\n\n".join(chunks).split("\n\n") == [p for p in paras]  # nothing lost or cut


def test_long_paragraph_is_split_at_sentences() -> None:
    para = " ".join(f"Sentence number {i} is here." for i in range(100))
    chunks = chunk_paragraphs([para], max_chars=300, min_chars=50)
    assert all(len(c) <= 300 and c.endswith(".") for c in chunks)
    assert " ".join(chunks) == para


def test_validation_section_is_contiguous_and_deterministic() -> None:
    section = contiguous_validation(100, 0.1, seed=7)
    assert len(section) == 10 and section == contiguous_validation(100, 0.1, seed=7)
    assert list(section) == list(range(section.start, section.stop))
    assert contiguous_validation(1, 0.1, seed=7) == range(0)


def test_exact_and_near_duplicates_are_found() -> None:
    base = " ".join(f"word{i}" for i in range(300))
    near = base.replace("word150", "changed")  # one word of 300 differs
    other = " ".join(f"other{i}" for i in range(300))
    exact, near_found = find_duplicates([base, base.upper() + "!", near, other], threshold=0.85)
    assert exact == {1}
    assert near_found == {2}
