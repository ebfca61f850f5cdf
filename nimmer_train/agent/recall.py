"""What an agent reads back: ``memory_search`` (hybrid search over the stores a mode allows, with
its bookkeeping: access counts, generated -> activated, the search log) and ``memory_get``
(exact lines of a workspace file). The fusion itself is search.py's; this module runs it over a
:class:`~nimmer_train.agent.crystal_store.CrystalStore`."""

from __future__ import annotations

import errno
import os
import re
import stat
from pathlib import Path, PurePosixPath

import apsw
import numpy as np

from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.crystals import Crystal, load, transition
from nimmer_train.agent.search import (
    STOPWORDS,
    LiveIndex,
    SearchWeights,
    dated_ranked,
    fuse,
    keyword_ranked,
    named_days,
    recency,
    weighted,
    without_days,
)
from nimmer_train.agent.subjects import (
    PLAYER_SPEAKERS,
    READ_CHARS,
    about_another,
    asked_about,
    player_said,
    said_about,
)
from nimmer_train.artifacts import NOFOLLOW
from nimmer_train.errors import NimmerError
from nimmer_train.memory.player_memory import Mode, as_mode

Hit = tuple[float, float, str, int]  # (score, similarity, store, entry id)
_DIRECTORY = getattr(os, "O_DIRECTORY", 0)


def memory_search(
    agent: CrystalStore,
    query: str,
    max_results: int = 6,
    min_score: float = 0.2,
    mode: Mode = Mode.REALWORLD,
    include_superseded: bool = False,
    include_expired: bool = False,
    vector: np.ndarray | None = None,
    use_text: bool = True,
    record_access: bool = True,
) -> list[dict[str, object]]:
    """Hybrid search (see search.py) over the stores ``mode`` allows; logs the search and
    counts an access on every hit (a generated crystal becomes activated)."""
    if not query.strip():
        raise NimmerError("query: empty; say what to search for")
    if max_results < 1:
        raise NimmerError(f"maxResults: {max_results} must be at least 1")
    mode = as_mode(mode)
    q = agent.embedder.embed([query])[0] if vector is None else vector
    now = agent.clock()
    w = agent.search_weights(now)
    hits: list[Hit] = []
    with agent.lock:
        for store in agent.stores(mode):
            hits += _scored(
                agent,
                store,
                query,
                q,
                max_results,
                min_score,
                w,
                now,
                include_superseded,
                include_expired,
                use_text,
            )
        hits.sort(key=lambda h: (-h[0], h[2], h[3]))
        hits = hits[:max_results]
        found: list[tuple[Hit, Crystal]] = []
        log_store = "clasp" if mode is Mode.IN_BETWEEN else "primary"  # a clasp query stays in clasp
        for store in agent.stores(mode):
            mine = [h for h in hits if h[2] == store]
            crystals = load(agent.db(store), [h[3] for h in mine], store)
            _bookkeep(
                agent, store, mine, crystals, hits if store == log_store else None, query, now, record_access
            )
            agent.after_commit(store)
            found += [(h, crystals[h[3]]) for h in mine]
    found.sort(key=lambda pair: (-pair[0][0], pair[0][2], pair[0][3]))
    out = []
    for (score, sim, _store, _id), crystal in found:
        item = crystal.public()
        item.update(score=round(score, 6), similarity=round(sim, 6))
        if crystal.path and crystal.start_line:
            item["citation"] = f"{crystal.path}#L{crystal.start_line}-L{crystal.end_line}"
        out.append(item)
    return out


def _scored(
    agent: CrystalStore,
    store: str,
    query: str,
    q: np.ndarray,
    max_results: int,
    min_score: float,
    w: SearchWeights,
    now: float,
    include_superseded: bool,
    include_expired: bool,
    use_text: bool,
) -> list[Hit]:
    """One store's candidates (by vector, by keyword and from a day the query names), fused and
    weighted; a candidate counts when its cosine reaches ``min_score`` or the query named it (a
    keyword, or the day it was said: a row of that day had no cosine and fell to ``min_score``)."""
    db, index = agent.db(store), agent.index(store)
    mask = index.mask(include_superseded, include_expired)
    by_vector = index.nearest(q, w.candidates * max_results, mask)
    n_text = w.text_candidates * max_results
    by_text = keyword_ranked(db, index, query, n_text, mask, w.text_min_idf_share) if use_text else []
    days = named_days(query, now) if w.date > 0 else []
    dated = dated_ranked(index, _day_vector(agent, query, q), days, n_text, mask) if days else []
    fused = fuse(by_vector, by_text, w, dated)
    if w.bridge > 0 and use_text and fused:
        bridged = _bridged(db, index, query, fused, n_text, mask, w)
        place = (w.rrf_k + 1) / (w.vector + w.text)  # in the fusion's units
        for n, (entry_id, strength) in enumerate(bridged, start=1):
            fused[entry_id] = fused.get(entry_id, 0.0) + w.bridge * strength * place / (w.rrf_k + n)
        by_text = [*by_text, *bridged]
    keyword_hits = {i for i, _ in by_text} | {i for i, _ in dated}
    sims = dict(by_vector)
    sims.update(index.similarity(q, [i for i in keyword_hits if i not in sims]))
    rows = (
        {
            r[0]: r[1:]
            for r in db.execute(
                f"SELECT entry_id, valid_from, importance, valid_to IS NOT NULL FROM crystals "
                f"WHERE entry_id IN ({', '.join('?' * len(fused))})",
                list(fused),
            )
        }
        if fused
        else {}
    )
    stale = set(fused) - set(rows)  # deleted on this connection (issue 5's pruning)
    if stale:
        index.remove(stale)
    others = _about_others(db, query, [i for i in fused if i not in stale]) if w.other else set()
    hits = []
    for entry_id, value in fused.items():
        if entry_id in stale:
            continue
        valid_from, imp, closed = rows[entry_id]
        fresh = recency(valid_from, now, w.recency_half_life_h)
        score = weighted(value, fresh, imp, w, closed, entry_id in others)
        if sims.get(entry_id, 0.0) >= min_score or entry_id in keyword_hits:
            hits.append((score, sims.get(entry_id, 0.0), store, entry_id))
    return hits


def _about_others(db: apsw.Connection, query: str, ids: list[int]) -> set[int]:
    """The candidates whose player's lines state someone else's fact when ``query`` asks about
    the player or one of the player's relations (subjects.py); none for any other query."""
    asked = asked_about(query)
    if asked is None or not ids:
        return set()
    rows = db.execute(  # the player's lines lead an exchange crystal: its start is all that is read
        f"SELECT id, substr(text, 1, ?) FROM entries WHERE id IN ({', '.join('?' * len(ids))}) "
        f"AND speaker IN ({', '.join('?' * len(PLAYER_SPEAKERS))})",
        [READ_CHARS + 200, *ids, *PLAYER_SPEAKERS],
    )
    return {entry_id for entry_id, text in rows if about_another(asked, said_about(player_said(text)))}


def _day_vector(agent: CrystalStore, query: str, q: np.ndarray) -> np.ndarray:
    """The vector that ranks a named day's rows: the query's words without the day (``q`` when
    nothing else is left)."""
    rest = without_days(query)
    return agent.embedder.embed([rest])[0] if rest and rest != query else q


_NAME = re.compile(r"\b[A-Z][a-z]{2,}\b")


def _bridged(
    db: apsw.Connection,
    index: LiveIndex,
    query: str,
    fused: dict[int, float],
    n: int,
    mask: np.ndarray,
    w: SearchWeights,
) -> list[tuple[int, float]]:
    """The second hop of a multi-hop question: the names (capitalised words) of the best
    ``w.bridge_seeds`` hits that the query does not hold, searched as keywords ("my best
    friend" finds "my best friend is Tomas"; "Tomas" then finds "Tomas moved to Oslo")."""
    seeds = sorted(fused, key=lambda i: -fused[i])[: w.bridge_seeds]
    asked = {word.lower() for word in re.findall(r"\w+", query)}
    names: dict[str, None] = {}
    for (text,) in db.execute(f"SELECT text FROM entries WHERE id IN ({', '.join('?' * len(seeds))})", seeds):
        for name in _NAME.findall(text):
            if name.lower() not in asked and name.lower() not in STOPWORDS:
                names[name] = None
    if not names:
        return []
    return [
        hit
        for hit in keyword_ranked(db, index, " ".join(names), n, mask, w.text_min_idf_share)
        if hit[0] not in seeds
    ]


def _bookkeep(
    agent: CrystalStore,
    store: str,
    mine: list[Hit],
    crystals: dict[int, Crystal],
    logged: list[Hit] | None,
    query: str,
    now: float,
    record_access: bool,
) -> None:
    """Count accesses on ``mine`` (generated -> activated) and log the search (``logged``).

    Soft state, so committed without an fsync (WAL, synchronous=NORMAL: the store stays
    consistent after a crash, the last few counts may be lost); a search stays fast.
    """
    db = agent.db(store)
    db.execute("PRAGMA synchronous=NORMAL")
    try:
        with db:
            if record_access and mine:
                db.executemany(
                    "UPDATE entries SET access_count = access_count + 1, last_access = ? WHERE id = ?",
                    [(now, h[3]) for h in mine],
                )
                for h in mine:
                    if crystals[h[3]].lifecycle == "generated":
                        transition(db, h[3], "activated", "retrieved by memory_search", now)
            if logged is not None:
                scores, sims = [h[0] for h in logged], [h[1] for h in logged]
                db.execute(
                    "INSERT INTO memory_search_log (at, query, results, top_score, mean_score, "
                    "top_similarity, mean_similarity) VALUES (?, ?, ?, ?, ?, ?, ?)",
                    (
                        now,
                        query,
                        len(logged),
                        max(scores, default=None),
                        float(np.mean(scores)) if scores else None,
                        max(sims, default=None),
                        float(np.mean(sims)) if sims else None,
                    ),
                )
    finally:
        db.execute("PRAGMA synchronous=FULL")


def memory_get(agent: CrystalStore, path: str, start: int = 1, lines: int | None = None) -> dict[str, object]:
    """Exact lines of a workspace memory file: ``lines`` lines from line ``start`` (1-based)."""
    workspace_file(agent.folder, path)
    if start < 1:
        raise NimmerError(f"from: {start} must be 1 or more (lines are numbered from 1)")
    if lines is not None and lines < 1:
        raise NimmerError(f"lines: {lines} must be 1 or more")
    try:
        all_lines = read_workspace_file(agent.folder, path).decode("utf-8").splitlines()
    except FileNotFoundError as exc:
        raise NimmerError(f"path: {path!r} does not exist in {agent.folder}") from exc
    except UnicodeDecodeError as exc:
        raise NimmerError(f"path: {path!r} is not valid UTF-8 (byte {exc.start})") from exc
    end = len(all_lines) if lines is None else min(len(all_lines), start - 1 + lines)
    chosen = all_lines[start - 1 : end]
    return {"path": path, "from": start, "lines": len(chosen), "text": "\n".join(chosen)}


def is_memory_file(relative: str) -> bool:
    """MEMORY.md, memory/*.md or skills/**.md: the files an agent's memory is made of."""
    parts = PurePosixPath(relative).parts
    if relative == "MEMORY.md":
        return True
    if len(parts) == 2 and parts[0] == "memory" and parts[1].endswith(".md"):
        return True
    return len(parts) >= 2 and parts[0] == "skills" and parts[-1].endswith(".md")


def workspace_file(folder: Path, path: str) -> Path:
    """The file of a workspace path (MEMORY.md, memory/*.md, skills/**.md); nothing outside."""
    if not isinstance(path, str) or not path or "\x00" in path:
        raise NimmerError(f"path: {path!r} must be a non-empty relative path without NUL bytes")
    relative = PurePosixPath(path)
    if relative.is_absolute() or ".." in relative.parts:
        raise NimmerError(f"path: {path!r} must be relative to the agent folder, without '..'")
    if not is_memory_file(relative.as_posix()):
        raise NimmerError(f"path: {path!r} is not a memory file (MEMORY.md, memory/*.md or skills/**.md)")
    return folder / relative


def read_workspace_file(folder: Path, path: str) -> bytes:
    """The bytes of a workspace file, read without leaving ``folder``: every component is opened
    relative to the one before with O_NOFOLLOW, so a symlink anywhere under the folder (the file,
    ``memory/``, a skills subfolder), swapped in before or during the walk, is refused rather than
    followed to a file outside (which ingestion would index and a Ring C turn could carry off).
    FileNotFoundError when it is not there; NimmerError naming ``path`` for anything refused."""
    parts = workspace_file(folder, path).relative_to(folder).parts
    fd = os.open(folder, os.O_RDONLY | _DIRECTORY)
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        flags = os.O_RDONLY | NOFOLLOW | (os.O_NONBLOCK if last else _DIRECTORY)  # a FIFO never blocks
        fd = _open_at(fd, part, flags, path)
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise NimmerError(f"path: {path!r} is not a regular file (a directory, a pipe or a device)")
    if info.st_nlink > 1:  # a hard link names a file that may live outside the folder too
        os.close(fd)
        raise NimmerError(
            f"path: {path!r} has other hard links; memory files are read only when they are the only name"
        )
    with os.fdopen(fd, "rb") as fh:
        return fh.read()


def _open_at(parent: int, name: str, flags: int, path: str) -> int:
    """``name`` opened in the directory ``parent``, which is closed here whatever happens."""
    try:
        return os.open(name, flags, dir_fd=parent)
    except OSError as exc:
        raise _refused(parent, name, path, exc) from exc
    finally:
        os.close(parent)


def _refused(parent: int, name: str, path: str, exc: OSError) -> Exception:
    """What a failed open means to the caller: O_NOFOLLOW answers a link with ELOOP (EMLINK on
    the BSDs), or ENOTDIR where a folder was asked for, as for a plain file; lstat tells them apart."""
    try:
        link = stat.S_ISLNK(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
    except OSError:
        link = False
    if link or exc.errno in (errno.ELOOP, errno.EMLINK):
        return NimmerError(
            f"path: {path!r} goes through a symbolic link; memory files are read only from inside "
            "the agent folder (replace the link with the file itself)"
        )
    if isinstance(exc, FileNotFoundError | NotADirectoryError):
        return FileNotFoundError(exc.errno, f"path: {path!r} does not exist")
    return NimmerError(f"path: {path!r} cannot be read ({exc.strerror})")
