"""Dataset cards in the Hugging Face format with the Datasheets-for-Datasets sections.

The human-written parts live in ``data_cards/<corpus>.md`` (YAML metadata plus prose); ingest
computes the figures and puts each table where the card has ``<!-- figures:NAME -->``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

import yaml

log = logging.getLogger(__name__)

SECTIONS = (
    "Motivation",
    "Composition",
    "Collection process",
    "Preprocessing",
    "Uses",
    "Distribution",
    "Maintenance",
)
_PLACEHOLDER = re.compile(r"<!--\s*figures:(\w+)\s*-->")


def size_category(n: int) -> str:
    """The Hugging Face ``size_categories`` bucket for ``n`` examples."""
    for limit, label in (
        (1_000, "n<1K"),
        (10_000, "1K<n<10K"),
        (100_000, "10K<n<100K"),
        (1_000_000, "100K<n<1M"),
        (10_000_000, "1M<n<10M"),
    ):
        if n < limit:
            return label
    return "n>10M"


def table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "_none_"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def split_front_matter(text: str) -> tuple[dict[str, Any], str]:
    if text.startswith("---\n"):
        head, _, body = text[4:].partition("\n---\n")
        return yaml.safe_load(head) or {}, body
    return {}, text


def render(human: Path, metadata: dict[str, Any], figures: dict[str, str]) -> str:
    """Merge the human card at ``human`` with computed metadata and figure tables."""
    if human.exists():
        meta, body = split_front_matter(human.read_text())
    else:
        log.warning("no human data card at %s; writing figures with empty prose sections", human)
        meta, body = {}, "\n".join(f"## {s}\n\n_To be written._\n" for s in SECTIONS)
    meta = {**meta, **metadata}
    used: set[str] = set()

    def fill(match: re.Match[str]) -> str:
        used.add(match.group(1))
        return figures.get(match.group(1), f"_no figures named {match.group(1)}_")

    body = _PLACEHOLDER.sub(fill, body)
    rest = [name for name in figures if name not in used]
    if rest:
        body += "\n## Figures\n\n" + "\n\n".join(f"### {n}\n\n{figures[n]}" for n in rest) + "\n"
    return "---\n" + yaml.safe_dump(meta, sort_keys=False, allow_unicode=True) + "---\n" + body
