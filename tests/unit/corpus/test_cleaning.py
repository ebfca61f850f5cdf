"""Decoding, Project Gutenberg stripping and normalisation on small synthetic files."""

import pytest

from nimmer_train.corpus.cleaning import UnusableFile, clean, decode, paragraphs, strip_gutenberg

HEADER_OLD = "The Project Gutenberg EBook of X\r\n\r\n*** START OF THIS PROJECT GUTENBERG EBOOK X ***\r\n"
FOOTER_OLD = (
    "\r\nEnd of the Project Gutenberg EBook of X\r\n\r\n*** END OF THIS PROJECT GUTENBERG EBOOK X ***"
    "\r\n\r\nTHE FULL PROJECT GUTENBERG LICENSE\r\nPlease read this before you distribute.\r\n"
)
BODY = "Sing, O goddess, the anger\r\nof Achilles.\r\n\r\nSecond paragraph here.\r\n"


def test_old_and_new_marker_wordings_are_stripped() -> None:
    old = (HEADER_OLD + BODY + FOOTER_OLD).encode()
    new = old.replace(b"THIS PROJECT", b"THE PROJECT")
    for raw in (old, new):
        text = clean(raw).text
        assert text == "Sing, O goddess, the anger of Achilles.\n\nSecond paragraph here."


def test_end_of_ebook_line_alone_ends_the_body() -> None:
    raw = (HEADER_OLD + BODY + "End of Project Gutenberg's X, by Y\r\nlicence text\r\n").encode()
    assert "licence" not in clean(raw).text


def test_file_without_markers_is_kept_whole() -> None:
    body, markers = strip_gutenberg("just a text\n")
    assert (body, markers) == ("just a text\n", False)


def test_encodings_are_detected_from_bytes() -> None:
    assert decode("Françoise".encode()) == ("Françoise", "utf-8")
    assert decode("Françoise".encode("latin-1")) == ("Françoise", "latin-1")
    assert decode("\u201cquoted\u201d café".encode("cp1252")) == ("\u201cquoted\u201d café", "cp1252")
    assert decode("\ufeffbom".encode("utf-8")) == ("bom", "utf-8")


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"", "empty"),
        (b"  \r\n ", "empty"),
        (b"\x89PNG\r\n\x1a\n\x00\x00\x00", "binary"),
        (bytes(range(1, 32)) * 50, "undecodable"),
    ],
)
def test_unusable_files_say_why(raw: bytes, reason: str) -> None:
    with pytest.raises(UnusableFile, match=reason):
        clean(raw)


def test_drop_rules_and_nfc() -> None:
    raw = "INTRODUCTION\n\nby the translator\n\nBOOK I\n\nCafe\u0301 text.\n\nINDEX\n\nA, 1".encode()
    text = clean(raw, drop_before=r"^BOOK I$", drop_after=r"^INDEX$").text
    assert text == "BOOK I\n\nCafé text."
    with pytest.raises(ValueError, match="matches no line"):
        clean(raw, drop_before=r"^NOPE$")


def test_verse_keeps_lines_prose_is_unwrapped() -> None:
    assert paragraphs("  Line one\n  line two\n\nprose\nwrapped") == ["Line one\nline two", "prose wrapped"]
