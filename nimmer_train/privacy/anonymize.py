"""Anonymisation of A.2 uploads, run on the device before anything leaves it.

Identifiers are replaced first, wherever they occur (also inside longer tokens): the player's id
and name and any other names the device knows to be people (``[player]``, ``[name]``). Then
emails, URLs, IP addresses, phone numbers (7 digits or more in groups) and street addresses are
scrubbed (``[email]``, ``[url]``, ``[ip]``, ``[phone]``, ``[address]``). Each upload gets a fresh
random id (uuid4) that links to nothing: not the player, not the contributor id, not an earlier
upload.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass

HEX = "[0-9a-f]{1,4}"
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # linear time: a whole local part is tried from the start of its run only (a match inside a
    # run implies one at its start); elsewhere (right after an earlier match) up to 64 characters
    (
        "[email]",
        re.compile(r"(?:(?<![\w.+-])[\w.+-]+|[\w.+-]{1,64})@[\w-]+(?:\.[\w-]+)+"),
    ),
    (
        "[url]",
        re.compile(
            # DNS bounds (labels of <= 63 chars, <= 127 of them) keep each try short: linear time
            r"(?:https?://|www\.)[^\s<>\"']+"
            r"|\b[\w-]{1,63}(?:\.[\w-]{1,63}){0,126}\.(?:com|org|net|io|de|uk|fr)\b"
            r"(?:/[^\s<>\"']*)?",
            re.I,
        ),
    ),
    (
        "[ip]",
        re.compile(
            rf"(?<![\w:])(?:(?:{HEX}:){{7}}{HEX}|(?:{HEX}:){{0,6}}{HEX}?::(?:{HEX}:){{0,6}}{HEX}?)"
            r"(?![\w:])|\b(?:(?:25[0-5]|2[0-4]\d|1?\d?\d)\.){3}(?:25[0-5]|2[0-4]\d|1?\d?\d)\b",
            re.I,
        ),
    ),
    (
        "[phone]",
        re.compile(
            r"(?<![\w/])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{1,4}\)[\s.-]?)?\d{2,5}(?:[\s.-]\d{2,5}){1,4}"
            r"(?!\w)"
        ),
    ),
    (
        "[address]",
        re.compile(
            r"\b\d{1,5}\s+(?:[A-Z][\w'-]*\s+){1,3}(?:Street|St|Avenue|Ave|Road|Rd|Lane|Ln|Boulevard|Blvd|Drive|Dr|"
            r"Way|Court|Ct|Place|Pl|Square|Sq|Strasse|Straße|Gasse)\b\.?"
        ),
    ),
)


@dataclass(frozen=True)
class Upload:
    upload_id: str  # fresh and random: links to nothing
    examples: tuple[dict[str, str], ...]


def _phone(match: re.Match[str]) -> str:
    return "[phone]" if sum(c.isdigit() for c in match.group()) >= 7 else match.group()


def scrub(text: str, player_id: str, player_name: str, other_names: tuple[str, ...] = ()) -> str:
    """``text`` with identifiers replaced and contact details scrubbed."""
    for names, placeholder in (((player_id, player_name), "[player]"), (other_names, "[name]")):
        for name in sorted((n for n in names if n.strip()), key=len, reverse=True):
            text = re.sub(re.escape(name), placeholder, text, flags=re.I)
    for placeholder, pattern in PATTERNS:
        text = pattern.sub(_phone if placeholder == "[phone]" else placeholder, text)
    return text


def anonymize(
    examples: list[dict[str, str]], player_id: str, player_name: str, other_names: tuple[str, ...] = ()
) -> Upload:
    """An A.2 upload of ``examples`` (from consent.training_examples for A2_anonymized)."""
    if not player_id:
        raise ValueError("anonymize needs the player_id, to keep it out of the upload")
    cleaned = tuple(
        {key: scrub(str(value), player_id, player_name, other_names) for key, value in ex.items()}
        for ex in examples
    )
    return Upload(str(uuid.uuid4()), cleaned)
