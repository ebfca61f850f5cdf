"""The ``agent`` extra of pyproject.toml: mcp, apscheduler and watchfiles serve only the standing
agent process (``nimmer memory mcp``: the MCP server, its consolidation schedule and its
workspace watcher). NPC turns, the memory tools in-process and ``nimmer memory consolidate``
need none of them, so the code that does imports them late and says in one line what is missing."""

from __future__ import annotations

from nimmer_train.errors import NimmerError


def missing_extra(package: str, needed_by: str) -> NimmerError:
    """The one-line error for a package of the agent extra that is not installed."""
    return NimmerError(
        f"{needed_by} needs {package}, which is not installed: it comes with the agent extra "
        "(pip install -e '.[agent]'; make install includes it)"
    )
