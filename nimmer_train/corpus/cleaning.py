"""Turn one raw ebook file into clean text: decode, normalise, strip Project Gutenberg matter.

Encoding is detected from the bytes (UTF-8 first, then CP1252 if it uses bytes 0x80-0x9F, else
Latin-1), so the same file always decodes the same way. Files that are empty, binary or
undecodable raise :class:`UnusableFile` with the reason; ingest skips them with a warning.
"""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

_START = re.compile(r"^\s*\*{3}\s*START OF (?:THIS|THE) PROJECT GUTENBERG E-?BOOK.*$", re.I | re.M)
_END = re.compile(
    r"^\s*(?:\*{3}\s*END OF (?:THIS|THE) PROJECT GUTENBERG E-?BOOK"
    r"|End of (?:the )?Project Gutenberg(?:'s)? (?:E-?Book|E-?text))",
    re.I | re.M,
)
_SMALL_PRINT_END = re.compile(r"^\s*\*END\*\s*THE SMALL PRINT!.*$", re.I | re.M)
_CREDITS = re.compile(r"^(?:Produced by|E-?text prepared by|Transcribed by)\b", re.I)
_ILLUSTRATION = re.compile(r"\[Illustration[^\]]*\]", re.I)
_BOILERPLATE = re.compile(r"project gutenberg|gutenberg\.(?:org|net)|\betext #\d+", re.I)
_SPACES = re.compile(r"[ \t\u00a0]+")


class UnusableFile(Exception):
    """A corpus file that cannot be used; ``reason`` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class CleanText:
    text: str  # paragraphs separated by one blank line
    encoding: str
    gutenberg_markers: bool
    boilerplate_paragraphs_dropped: int


def decode(raw: bytes) -> tuple[str, str]:
    """Decode ebook bytes; return (text, encoding). Raises UnusableFile for empty or binary data."""
    if not raw.strip():
        raise UnusableFile("empty file")
    if b"\x00" in raw[:65536]:
        raise UnusableFile("binary data (NUL bytes); expected plain text")
    try:
        text, encoding = raw.decode("utf-8-sig"), "utf-8"
    except UnicodeDecodeError:
        if any(0x80 <= b <= 0x9F for b in raw):
            try:
                text, encoding = raw.decode("cp1252"), "cp1252"
            except UnicodeDecodeError as exc:
                raise UnusableFile(f"not UTF-8, CP1252 or Latin-1 text ({exc.reason})") from exc
        else:
            text, encoding = raw.decode("latin-1"), "latin-1"
    control = sum(1 for ch in text if ord(ch) < 32 and ch not in "\r\n\t\f")
    if control > 0.001 * len(text):
        raise UnusableFile(f"undecodable: {control} control characters in {encoding} text")
    return text, encoding


def strip_gutenberg(text: str) -> tuple[str, bool]:
    """Keep only the body between the START and END markers; return (body, markers_found)."""
    start = _START.search(text) or _SMALL_PRINT_END.search(text)
    end = _END.search(text, start.end() if start else 0)
    if not start and not end:
        return text, False
    body = text[start.end() if start else 0 : end.start() if end else len(text)]
    return body, True


def apply_drop_rules(text: str, drop_before: str | None, drop_after: str | None) -> str:
    """Drop front matter before the first line matching ``drop_before`` and back matter from
    the first line matching ``drop_after``. A rule that matches nothing raises ValueError."""
    if drop_before:
        match = re.search(drop_before, text, re.M)
        if not match:
            raise ValueError(f"drop_before pattern {drop_before!r} matches no line")
        text = text[match.start() :]
    if drop_after:
        match = re.search(drop_after, text, re.M)
        if not match:
            raise ValueError(f"drop_after pattern {drop_after!r} matches no line")
        text = text[: match.start()]
    return text


def paragraphs(text: str) -> list[str]:
    """Split on blank lines. Prose lines are unwrapped; indented blocks (verse) keep their lines."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        lines = [line for line in block.split("\n") if line.strip()]
        if not lines:
            continue
        verse = len(lines) > 1 and all(line[:1] in (" ", "\t") for line in lines)
        joiner = "\n" if verse else " "
        para = joiner.join(_SPACES.sub(" ", line).strip() for line in lines)
        out.append(para)
    return out


def clean(raw: bytes, drop_before: str | None = None, drop_after: str | None = None) -> CleanText:
    """Bytes of one ebook to clean NFC text, paragraphs separated by blank lines."""
    text, encoding = decode(raw)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = unicodedata.normalize("NFC", text)
    body, markers = strip_gutenberg(text)
    body = apply_drop_rules(body, drop_before, drop_after)
    body = _ILLUSTRATION.sub("", body)
    kept, dropped = [], 0
    for i, para in enumerate(paragraphs(body)):
        if _BOILERPLATE.search(para) or (i < 5 and _CREDITS.match(para)):
            dropped += 1
            continue
        kept.append(para)
    if not kept:
        raise UnusableFile("no text left after removing Project Gutenberg matter")
    return CleanText("\n\n".join(kept), encoding, markers, dropped)
