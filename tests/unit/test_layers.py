"""The house's layers, read from the source (ast): a module of nimmer_train imports its own package
or a package of a lower layer in the data flow, never one beside or above it; no two modules
import each other, directly or round a circle (inside a package too); and the library never
imports the Hydra entry points (``pipelines``) or Hydra itself. Every import counts: at module
level, inside functions, and under ``if TYPE_CHECKING:``, so a function-local import cannot
hide a circle."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.helpers import REPO

LIBRARY = REPO / "nimmer_train"

# Low to high. A unit is a package under nimmer_train/ or a module at its root; "nimmer_train" is
# the root package's own __init__. Imports inside one unit are free; across units they must go to
# a strictly lower layer, so two packages of one layer may not import each other.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("nimmer_train", "errors", "artifacts", "progress"),
    ("voice",),
    ("config",),
    ("tracking", "privacy", "backup"),
    ("memory",),  # the device's stores: consent anonymises A.2 uploads with privacy.anonymize
    ("agent",),  # the agent runtime over the player's stores: crystals, search, dreams, tools
    ("corpus",),
    ("base",),
    ("synth",),
    ("loras",),
    ("federation",),
    ("publish",),
    ("runtime",),
    ("review",),  # what the review notebooks read: the store, the releases, the export paths
    ("run_all", "cli"),
)
LAYER = {unit: level for level, units in enumerate(LAYERS) for unit in units}

# Edges that break the layers today and are waiting on a decision (library code is not changed
# from the tests). Each entry must still exist: drop it once the edge or the layering changes.
KNOWN: set[tuple[str, str]] = set()

FORBIDDEN = ("pipelines", "hydra")


def _module_name(path: Path) -> tuple[str, bool]:
    """(dotted module name, whether it is a package's __init__)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def _unit(module: str) -> str | None:
    """The layered unit a module belongs to; None outside nimmer_train."""
    parts = module.split(".")
    if parts[0] != "nimmer_train":
        return None
    return parts[1] if len(parts) > 1 else "nimmer_train"


def _imports(path: Path) -> Iterator[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved. For
    ``from package import name`` the target is ``package.name`` when that is a module of
    nimmer_train (``from nimmer_train.agent import curiosity``), else ``package``."""
    module, is_package = _module_name(path)
    package = module.split(".") if is_package else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parent = package[: len(package) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                named = f"{base}.{alias.name}"
                yield (named if not node.module or _is_module(named) else base), node.lineno


def _is_module(name: str) -> bool:
    """Whether a dotted name is a module or package of nimmer_train (a file under LIBRARY)."""
    path = REPO.joinpath(*name.split("."))
    return name.startswith("nimmer_train.") and (path.with_suffix(".py").is_file() or path.is_dir())


def _library() -> list[Path]:
    files = sorted(LIBRARY.rglob("*.py"))
    assert files, f"no modules under {LIBRARY}"
    return files


def test_imports_go_down_the_layers() -> None:
    offending, unlayered, seen_known = [], set(), set()
    for path in _library():
        module, _ = _module_name(path)
        here = _unit(module)
        if here not in LAYER:
            unlayered.add(here)
            continue
        for target, line in _imports(path):
            there = _unit(target)
            if there is None or there == here:
                continue
            if there not in LAYER:
                unlayered.add(there)
                continue
            if LAYER[there] < LAYER[here]:
                continue
            if (module, target) in KNOWN:
                seen_known.add((module, target))
                continue
            offending.append(
                f"{path.relative_to(REPO)}:{line}: {module} ({here}, layer {LAYER[here]}) imports "
                f"{target} ({there}, layer {LAYER[there]})"
            )
    assert not unlayered, f"units with no layer in LAYERS: {sorted(unlayered)}"
    assert not offending, "imports that go beside or up the layers:\n" + "\n".join(offending)
    stale = sorted(KNOWN - seen_known)
    assert not stale, f"KNOWN edges that no longer exist (drop them from KNOWN): {stale}"


def test_library_never_imports_pipelines_or_hydra() -> None:
    offending = [
        f"{path.relative_to(REPO)}:{line}: imports {target}"
        for path in _library()
        for target, line in _imports(path)
        if target.split(".")[0] in FORBIDDEN
    ]
    assert not offending, "the library imports the Hydra entry points or Hydra:\n" + "\n".join(offending)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph.get(module, ())):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == module:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_no_import_circles() -> None:
    graph: dict[str, set[str]] = {}
    lines: dict[tuple[str, str], int] = {}
    for path in _library():
        module, _ = _module_name(path)
        for target, line in _imports(path):
            if _is_module(target) and target != module:
                graph.setdefault(module, set()).add(target)
                lines.setdefault((module, target), line)
    circles = _circles(graph)
    described = [
        " <-> ".join(members)
        + ": "
        + ", ".join(
            f"{a}:{lines[a, b]} imports {b}" for a in members for b in sorted(graph[a]) if b in members
        )
        for members in circles
    ]
    assert not circles, "modules that import each other round a circle:\n" + "\n".join(described)
