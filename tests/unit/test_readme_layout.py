"""The README's Layout names every module of the library where it lives, and nothing that is gone:
a newcomer reads the tree there. Each package's entry is ``  name/  what it is: mod, mod (note), ...``
(the list after the first colon, continued on the lines below it); root modules are ``  name.py``."""

from __future__ import annotations

import re

from tests.helpers import REPO

LIBRARY = REPO / "nimmer_train"


def _layout_block() -> list[str]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1].splitlines()


def _library_entries() -> dict[str, str]:
    """The library's part of the block: each entry's text (first line plus its continuation lines)
    by its name (``memory/``, ``errors.py``)."""
    entries: dict[str, str] = {}
    inside, current = False, None
    for line in _layout_block():
        if line.startswith("nimmer_train/"):
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break  # the next top-level folder
        if not inside:
            continue
        match = re.match(r"  (\S+)\s+(.*)$", line)
        if match:
            current = match.group(1)
            entries[current] = match.group(2)
        elif current and line.strip():
            entries[current] += " " + line.strip()
    return entries


def _listed(text: str) -> set[str]:
    """The names after an entry's first colon: notes in brackets dropped, ``.py`` dropped."""
    names = re.sub(r"\([^()]*\)", "", text.split(": ", 1)[1]) if ": " in text else ""
    return {n.strip().removesuffix(".py") for n in names.split(",") if n.strip()}


def _modules(package: str) -> set[str]:
    folder = LIBRARY / package
    modules = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    return modules | {f"{p.name}/" for p in folder.iterdir() if (p / "__init__.py").is_file()}


def test_every_package_and_root_module_of_the_library_has_an_entry() -> None:
    entries = _library_entries()
    packages = {f"{p.name}/" for p in LIBRARY.iterdir() if (p / "__init__.py").is_file()}
    roots = {p.name for p in LIBRARY.glob("*.py") if p.name != "__init__.py"}
    assert set(entries) == packages | roots, (
        f"README Layout: missing {sorted(packages | roots - set(entries))}, "
        f"gone {sorted(set(entries) - packages - roots)}"
    )


def test_each_package_entry_lists_exactly_its_modules() -> None:
    wrong = []
    for name, text in _library_entries().items():
        if not name.endswith("/"):
            continue
        have, listed = _modules(name.rstrip("/")), _listed(text)
        if have != listed:
            missing, absent = sorted(have - listed), sorted(listed - have)
            wrong.append(f"{name}: not listed {missing}, listed but absent {absent}")
    assert not wrong, "README Layout out of step with nimmer_train/:\n" + "\n".join(wrong)
