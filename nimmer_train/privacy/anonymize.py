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
LOCAL_MAX = 64  # characters of an email's local part glued to the end of an earlier match
TLDS = ("com", "org", "net", "io", "de", "uk", "fr")
# Linear time, whatever the text (a device scrubs its own text, the intake checks every upload):
# each pattern starts where a run starts (not inside one) and takes it whole, possessively, so no
# position is tried twice; what the old bounded patterns decided by backtracking is decided in
# Python on the one run (_emails, _urls).
# an "@" and the domain after it; the local part is found leftwards from the "@" (_emails)
EMAIL_AT = re.compile(r"@[\w-]+(?:\.[\w-]+)+")
# a scheme or www. to the next space or quote, or a whole dotted run (its host) and its path
URL_ANY = re.compile(
    r"(?P<prefixed>(?:https?://|www\.)[^\s<>\"']++)"
    r"|(?P<host>(?<![\w-])[\w-]++(?:\.[\w-]++)++)",
    re.I,
)
# A host's path, taken only once the host is a domain: matched with the host, a run that is no
# domain would take the rest of the text as its path and the next search would start inside it
# again (quadratic on "a.b/" * n).
URL_PATH = re.compile(r"/[^\s<>\"']*+")
URL_PREFIX = re.compile(r"https?://|www\.", re.I)
URL_PREFIXED = re.compile(r"(?:https?://|www\.)[^\s<>\"']++", re.I)
TLD_LABEL = re.compile(rf"(?:{'|'.join(TLDS)})(?!\w)", re.I)
PATTERNS: tuple[tuple[str, re.Pattern[str]], ...] = (
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


def _local(ch: str) -> bool:
    """Whether ``ch`` may be in an email's local part (``[\\w.+-]``: ``\\w`` is isalnum or _)."""
    return ch.isalnum() or ch in "_.+-"


def _emails(text: str) -> str:
    """Every email as ``[email]``: an "@" with a domain after it, and before it the whole run of
    local-part characters, or its last LOCAL_MAX where the run is glued to an earlier email.
    Each character is looked at a bounded number of times: the scan left stops at the last match."""
    out, done = [], 0
    for match in EMAIL_AT.finditer(text):
        at = start = match.start()
        while start > done and _local(text[start - 1]):
            start -= 1
        if start == at:
            continue  # no local part: not an email (its domain may yet be a later local part)
        if start == done > 0 and _local(text[done - 1]) and at - start > LOCAL_MAX:
            start = at - LOCAL_MAX
        out += [text[done:start], "[email]"]
        done = match.end()
    return "".join(out) + text[done:]


def _domain(host: str) -> tuple[int, int] | None:
    """Where a domain is in ``host`` (a dotted run): from its first word character through its
    last label that is (or starts with) a top-level domain, with a dot between; None if none."""
    labels = host.split(".")
    first = next((i for i, c in enumerate(host) if c.isalnum() or c == "_"), len(host))
    for index in range(len(labels) - 1, 0, -1):
        tld = TLD_LABEL.match(labels[index])
        if tld:
            dot = sum(len(label) + 1 for label in labels[:index]) - 1
            return (first, dot + 1 + tld.end()) if first < dot else None
    return None


def _prefixed_inside(text: str, start: int, end: int) -> re.Match[str] | None:
    """The first URL with a scheme or www. that starts in ``text[start:end]`` (it may run on)."""
    for prefix in URL_PREFIX.finditer(text, start, end + len("https://")):
        if prefix.start() >= end:
            return None
        if found := URL_PREFIXED.match(text, prefix.start()):
            return found
    return None


def _urls(text: str) -> str:
    """Every URL as ``[url]``, leftmost first: a scheme or www. to the next space or quote, or a
    dotted run through its last top-level-domain label (with the path when that label ends the
    host). A run without one is no URL, but a scheme or www. may start inside it."""
    out, pos = [], 0
    while match := URL_ANY.search(text, pos):
        start, end = match.span()
        if match.group("host") is not None:
            host_end = match.end("host")
            domain = _domain(match.group("host"))
            if domain is None:
                inner = _prefixed_inside(text, start + 1, host_end)
                if inner is None:
                    out.append(text[pos:host_end])
                    pos = host_end
                    continue
                start, end = inner.span()
            elif prefixed := URL_PREFIXED.match(text, start + domain[0]):  # it comes first
                start, end = prefixed.span()
            else:
                start, end = start + domain[0], start + domain[1]
                if end == host_end and (path := URL_PATH.match(text, host_end)):
                    end = path.end()
        out += [text[pos:start], "[url]"]
        pos = end
    return "".join(out) + text[pos:]


def scrub(text: str, player_id: str, player_name: str, other_names: tuple[str, ...] = ()) -> str:
    """``text`` with identifiers replaced and contact details scrubbed (in time linear in the
    text: the intake runs this on every upload it is sent)."""
    for names, placeholder in (((player_id, player_name), "[player]"), (other_names, "[name]")):
        for name in sorted((n for n in names if n.strip()), key=len, reverse=True):
            text = re.sub(re.escape(name), placeholder, text, flags=re.I)
    text = _urls(_emails(text))
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
