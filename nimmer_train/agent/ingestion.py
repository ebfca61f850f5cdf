"""Ingestion: workspace memory files, skills and session transcripts become crystals.

- ``MEMORY.md`` and ``memory/*.md``: chunked along Markdown structure (a heading starts a new
  chunk; paragraphs pack up to the embedder's window, counted by its tokenizer), each chunk
  with its 1-based line range so ``memory_get`` can quote it (a line longer than the window is
  cut at words). Re-ingesting a file embeds only chunks whose hash is new, moves the line range
  of unchanged chunks, and expires chunks that are gone; a deleted file's
  crystals expire. ``memory/scratch.md`` is read one note line per crystal (the
  working_memory_note format). Invalid UTF-8 or binary files, and files reached through a
  symlink (read only inside the agent folder: recall.read_workspace_file), are skipped with a
  warning that names the file. A file that changes while it is read is read again until it holds still.
- ``skills/**.md``: the same chunks, as frozen crystals (never decayed).
- Transcripts: :class:`TranscriptIndexer` turns each exchange into an episode crystal on a
  background thread (speaker, session id, turn ids, timestamp), so a turn never waits for it;
  an exchange over the entry limit is split into parts that say so, a failed batch is retried
  one exchange at a time (transient faults with a short backoff), an in-between exchange whose
  clasp store is open elsewhere waits for it, and only what still fails is dropped, with a log
  line naming it and why.
- :class:`WorkspaceWatcher` runs ingestion on every change that ``watchfiles`` reports.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from nimmer_train.agent.crystal_store import CrystalStore
from nimmer_train.agent.crystals import CrystalSpec, content_hash
from nimmer_train.agent.extra import missing_extra
from nimmer_train.agent.recall import is_memory_file, read_workspace_file
from nimmer_train.agent.scratch import SCRATCH, note_spec
from nimmer_train.errors import NimmerError
from nimmer_train.memory.clasp import ClaspBusy
from nimmer_train.memory.entries import EXCHANGE_SPEAKER
from nimmer_train.memory.player_memory import Mode, as_mode

log = logging.getLogger(__name__)
MAX_CHUNK_CHARS = 1600  # Bitterbot's 400 tokens at 4 characters a token


@dataclass(frozen=True)
class Chunk:
    start_line: int
    end_line: int
    text: str


def chunk_markdown(
    text: str, max_chars: int = MAX_CHUNK_CHARS, size: Callable[[str], int] = len
) -> list[Chunk]:
    """Chunks along headings and blank-line paragraphs, each at most ``max_chars`` (measured by
    ``size``: characters, or an embedder's word pieces) unless one line is longer; lines are
    numbered from 1 and ranges are inclusive."""
    lines = text.splitlines()
    sizes = [size(line) + 1 for line in lines]
    blocks: list[tuple[int, int]] = []  # paragraphs and headings as (first, last) indexes
    start = None
    for i, line in enumerate(lines):
        if line.lstrip().startswith("#"):
            if start is not None:
                blocks.append((start, i - 1))
            blocks.append((i, i))
            start = None
        elif not line.strip():
            if start is not None:
                blocks.append((start, i - 1))
            start = None
        elif start is None:
            start = i
    if start is not None:
        blocks.append((start, len(lines) - 1))

    chunks: list[Chunk] = []
    first = last = None
    used = 0
    heading_only = False  # a heading stays with the text below it

    def close() -> None:
        nonlocal first, last, used
        if first is not None and last is not None:
            body = "\n".join(lines[first : last + 1]).strip()
            if body:
                chunks.append(Chunk(first + 1, last + 1, body))
        first = last = None
        used = 0

    for a, b in blocks:
        heading = a == b and lines[a].lstrip().startswith("#")
        length = sum(sizes[a : b + 1])
        if heading or (first is not None and not heading_only and used + length > max_chars):
            close()
        if length > max_chars:  # one long paragraph: split by lines
            for i in range(a, b + 1):
                if sizes[i] > max_chars:  # one line longer than the budget: cut at words
                    close()
                    chunks.extend(Chunk(i + 1, i + 1, p) for p in _cut_line(lines[i], max_chars, size))
                    heading_only = False
                    continue
                if first is not None and not heading_only and used + sizes[i] > max_chars:
                    close()
                first = i if first is None else first
                last, used, heading_only = i, used + sizes[i], False
            continue
        first = a if first is None else first
        last, used, heading_only = b, used + length, heading
    close()
    return chunks


def _cut_line(line: str, budget: int, size: Callable[[str], int]) -> list[str]:
    """``line`` in pieces of whole words, each within ``budget`` by ``size`` (a single word
    longer than that stays whole: the embedder reads its start)."""
    pieces: list[str] = []
    words: list[str] = []
    used = 0
    for word in line.split():
        n = size(word) + 1
        if words and used + n > budget:
            pieces.append(" ".join(words))
            words, used = [], 0
        words.append(word)
        used += n
    if words:
        pieces.append(" ".join(words))
    return pieces


def workspace_files(folder: Path) -> list[str]:
    found = [p for p in [folder / "MEMORY.md"] if p.is_file()]
    found += sorted((folder / "memory").glob("*.md"))
    found += sorted((folder / "skills").rglob("*.md"))
    return [p.relative_to(folder).as_posix() for p in found if p.is_file()]


def window_size(embedder: object) -> tuple[int, Callable[[str], int]]:
    """The chunk budget for ``embedder``: its window in word pieces counted by its tokenizer
    (SentenceEmbedder: 254), or MAX_CHUNK_CHARS characters for one that does not say."""
    window, count = getattr(embedder, "window", None), getattr(embedder, "count_tokens", None)
    if isinstance(window, int) and callable(count):
        return window, count
    return MAX_CHUNK_CHARS, len


def specs_for(relative: str, text: str, embedder: object = None) -> list[CrystalSpec]:
    if relative == SCRATCH:
        out = []
        for n, line in enumerate(text.splitlines(), start=1):
            if line.startswith("- ["):
                try:
                    out.append(note_spec(line, relative, n))
                except Exception:  # noqa: BLE001 - a hand-edited line: indexed as a plain chunk
                    out.append(CrystalSpec(line[2:], "note", path=relative, start_line=n, end_line=n))
        return out
    origin = "skill" if relative.startswith("skills/") else "file"
    return [
        CrystalSpec(
            c.text,
            origin,
            path=relative,
            start_line=c.start_line,
            end_line=c.end_line,
            speaker="workspace",
            lifespan="permanent" if origin == "skill" else "decay",
        )
        for c in chunk_markdown(text, *window_size(embedder))
    ]


def _read_settled(folder: Path, relative: str, attempts: int = 5) -> bytes | None:
    """The file's bytes once two reads agree (a file being written converges), or None if gone.
    Read inside ``folder`` only (recall.read_workspace_file): a symlink is NimmerError, never
    followed, so nothing outside the agent folder is indexed."""
    try:
        data = read_workspace_file(folder, relative)
        for _ in range(attempts):
            again = read_workspace_file(folder, relative)
            if again == data:
                return data
            data = again
            time.sleep(0.05)
        return data
    except FileNotFoundError:
        return None


def _unchanged(folder: Path, relative: str, data: bytes) -> bool:
    try:
        return _read_settled(folder, relative) == data
    except NimmerError:  # swapped for a link while we embedded: the next pass refuses it
        return False


def ingest_file(agent: CrystalStore, relative: str) -> dict[str, int]:
    """Bring one workspace file's crystals in step with the file (see the module docstring)."""
    path = agent.folder / relative
    counts = {"added": 0, "kept": 0, "expired": 0, "skipped": 0}
    for _ in range(5):
        try:
            data = _read_settled(agent.folder, relative)
        except NimmerError as exc:
            log.warning("%s: %s; skipped, its crystals are left as they were", path, exc)
            counts["skipped"] = 1
            return counts
        specs: list[CrystalSpec] = []
        if data is not None:
            if b"\x00" in data:
                log.warning("%s: binary file (NUL byte); skipped, its crystals are left as they were", path)
                counts["skipped"] = 1
                return counts
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as exc:
                log.warning(
                    "%s: not valid UTF-8 (byte %d); skipped, its crystals are left as they were",
                    path,
                    exc.start,
                )
                counts["skipped"] = 1
                return counts
            specs = specs_for(relative, text, agent.embedder)
        hashes = [s.source_hash or content_hash(s.text) for s in specs]
        with agent.lock:
            db = agent.db("primary")
            existing: dict[str, list[tuple[int, int | None, int | None]]] = {}
            for entry_id, digest, a, b in db.execute(
                "SELECT entry_id, content_hash, start_line, end_line FROM crystals WHERE path = ? "
                "AND lifecycle != 'expired' ORDER BY entry_id",
                (relative,),
            ):
                existing.setdefault(digest, []).append((entry_id, a, b))
            new, moved = [], []
            for spec, digest in zip(specs, hashes, strict=True):
                if existing.get(digest):
                    entry_id, a, b = existing[digest].pop(0)
                    counts["kept"] += 1
                    if (a, b) != (spec.start_line, spec.end_line):
                        moved.append((spec.start_line, spec.end_line, entry_id))
                else:
                    new.append(spec)
            gone = [entry_id for rows in existing.values() for entry_id, _, _ in rows]
        vectors = agent.embedder.embed([s.text for s in new]) if new else np.zeros((0, 384), np.float32)
        if data is not None and not _unchanged(agent.folder, relative, data):
            continue  # edited while we embedded: start again from the new content
        with agent.lock, agent.db("primary"):
            db = agent.db("primary")
            db.executemany("UPDATE crystals SET start_line = ?, end_line = ? WHERE entry_id = ?", moved)
            reason = "source file deleted" if data is None else "source chunk changed or removed"
            counts["expired"] = agent.move("primary", gone, "expired", reason)
            ids = agent.add(new, Mode.REALWORLD, vectors)
            counts["added"] = len(ids)
            directives = [i for i, s in zip(ids, new, strict=True) if s.directive]
            if directives:
                agent.settle_directives("primary", directives)
        return counts
    log.warning("%s: still changing after 5 reads; left for the next change event", path)
    return counts


def ingest_workspace(agent: CrystalStore) -> dict[str, int]:
    """Ingest every workspace file, and expire the crystals of files that are gone."""
    total = {"files": 0, "added": 0, "kept": 0, "expired": 0, "skipped": 0}
    present = workspace_files(agent.folder)
    known = {
        r[0]
        for r in agent.db("primary").execute(
            "SELECT DISTINCT path FROM crystals WHERE path IS NOT NULL AND lifecycle != 'expired'"
        )
    }
    for relative in sorted(set(present) | known):
        counts = ingest_file(agent, relative)
        total["files"] += 1
        for key, value in counts.items():
            total[key] += value
    return total


class WorkspaceWatcher:
    """Ingests workspace files as ``watchfiles`` reports them changed, on a daemon thread."""

    def __init__(self, agent: CrystalStore, debounce_ms: int = 1500) -> None:
        self.agent, self.debounce_ms = agent, debounce_ms
        self.stop_event = threading.Event()
        self.pending: set[str] = set()
        self.thread = threading.Thread(target=self._run, name="memory-watcher", daemon=True)
        self.ready = threading.Event()

    def start(self) -> WorkspaceWatcher:
        try:  # the agent extra (extra.py): only a standing server watches the workspace
            from watchfiles import watch
        except ImportError as exc:
            raise missing_extra("watchfiles", "the workspace watcher") from exc
        self._watch = watch
        self.agent.folder.mkdir(parents=True, exist_ok=True)
        self.thread.start()
        self.ready.wait(timeout=30)
        return self

    def _accept(self, _change: object, path: str) -> bool:
        try:
            relative = Path(path).relative_to(self.agent.folder).as_posix()
        except ValueError:
            return False
        return is_memory_file(relative)

    def _run(self) -> None:
        self.ready.set()
        for changes in self._watch(
            self.agent.folder,
            watch_filter=self._accept,
            debounce=self.debounce_ms,
            stop_event=self.stop_event,
            yield_on_timeout=False,
        ):
            self.pending |= {Path(p).relative_to(self.agent.folder).as_posix() for _, p in changes}
            while self.pending:
                relative = sorted(self.pending)[0]
                self.pending.discard(relative)
                for attempt in range(3):  # a transient failure (a busy store) must not lose the change
                    try:
                        ingest_file(self.agent, relative)
                        break
                    except Exception:  # a bad file must not stop the watcher
                        if attempt == 2:
                            log.exception("ingesting %s failed", relative)
                        else:
                            time.sleep(0.2)

    def stop(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=30)


@dataclass(frozen=True)
class Exchange:
    """One exchange of a session: its messages as (speaker, text), in order. ``mode`` may be a
    :class:`Mode` or its value ("in_between" is the in-between, as Mode.IN_BETWEEN is)."""

    session_id: str
    turn_ids: tuple[str, ...]
    messages: tuple[tuple[str, str], ...]
    at: float
    mode: Mode | str = Mode.REALWORLD
    data_category: str | None = (
        None  # the consent category (the runtime's turns: casual_dialog); None: the agent's
    )
    enqueued: float = field(default_factory=time.monotonic)
    valence: float = 0.0  # the turn's emotional valence (affect and detected events), in [-1, 1]
    traits: dict[str, float] = field(default_factory=dict)  # the trait profile of the register that heard it

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", as_mode(self.mode))
        if not self.messages:
            raise NimmerError(f"exchange {self.session_id} {list(self.turn_ids)}: no messages")

    def label(self) -> str:
        return f"{self.session_id} {','.join(self.turn_ids) or '(no turn id)'}"


CONTINUED = " (continued)"
_SURROGATE = re.compile("[\ud800-\udfff]")  # a lone half of a UTF-16 pair


def _repaired(text: str) -> str:
    """``text`` storable as UTF-8: a lone surrogate (a broken client's half of a pair) becomes
    U+FFFD, as a decoder does with a bad byte; the rest of the line is kept."""
    return _SURROGATE.sub("\ufffd", text)


def _pieces(text: str, size: int) -> list[str]:
    """``text`` cut into pieces of at most ``size`` characters, at whitespace where there is some
    in the second half of a piece."""
    out = []
    while len(text) > size:
        cut = text.rfind(" ", size // 2, size + 1)
        cut = size if cut <= 0 else cut
        out.append(text[:cut].rstrip())
        text = text[cut:].lstrip()
    return [*out, text] if text or not out else out


def exchange_specs(exchange: Exchange, max_chars: int = 4000) -> list[CrystalSpec]:
    """The episode crystals of one exchange: one, with its messages as "speaker: text" lines;
    or, when that is over ``max_chars`` (the store's entry limit), several, each headed
    "[exchange part k of n, split to fit the entry limit]", each line still naming its speaker
    ("speaker (continued): ..."), all with the exchange's session and turn ids. Lone surrogates
    become U+FFFD. The speaker is the one speaker, or :data:`EXCHANGE_SPEAKER` when several
    spoke (no one person said the text).

    The vector is made of what was said, without the speaker labels (``embed_text``): the same
    "player:" and "npc:companion:" on every crystal pulled all vectors toward one another, and
    a first-person question toward any line of the player's (the long-conversation benchmark:
    evidence recall@10 0.66 with the labels, 0.76 without). The labels stay in the text, so a
    keyword search still finds a speaker's name."""
    messages = [(speaker, _repaired(str(said))) for speaker, said in exchange.messages]
    speakers = {speaker for speaker, _ in messages}
    speaker = messages[0][0] if len(speakers) == 1 else EXCHANGE_SPEAKER
    whole = [(f"{who}: ", said) for who, said in messages]
    if sum(len(a) + len(b) + 1 for a, b in whole) - 1 <= max_chars:
        parts, head = [whole], ""
    else:
        parts = _split(
            messages, max_chars - len("[exchange part 999 of 999, split to fit the entry limit]\n")
        )
        head = "[exchange part {k} of {n}, split to fit the entry limit]\n"
    category = {} if exchange.data_category is None else {"data_category": exchange.data_category}
    return [
        CrystalSpec(
            head.format(k=k, n=len(parts)) + "\n".join(label + said for label, said in part),
            "transcript",
            semantic_type="episode",
            session_id=exchange.session_id,
            turn_ids=exchange.turn_ids,
            speaker=speaker,
            valid_from=exchange.at,
            emotional_valence=exchange.valence,
            embed_text="\n".join(said for _label, said in part),
            # in the in-between the store makes it clasp, whatever is asked
            entry_fields={**category, "trait_engagement": dict(exchange.traits)},
        )
        for k, part in enumerate(parts, start=1)
    ]


def _split(messages: list[tuple[str, str]], room: int) -> list[list[tuple[str, str]]]:
    """Messages as (label, words) lines packed into parts of at most ``room`` characters; a
    message too long for one part is cut at whitespace, its later pieces labelled "(continued)"."""
    lines = []
    for who, said in messages:
        size = max(1, room - len(f"{who}{CONTINUED}: "))
        for i, piece in enumerate(_pieces(said, size)):
            lines.append((f"{who}{CONTINUED if i else ''}: ", piece))
    parts: list[list[tuple[str, str]]] = []
    for line in lines:
        length = sum(len(a) + len(b) + 1 for a, b in parts[-1]) if parts else 0
        if parts and length + len(line[0]) + len(line[1]) <= room:
            parts[-1].append(line)
        else:
            parts.append([line])
    return parts


def index_exchanges(agent: CrystalStore, exchanges: Iterable[Exchange]) -> list[int]:
    """Index exchanges now, each mode's in one transaction (what the background indexer does
    per batch); an exchange too long for one entry becomes several crystals."""
    ids: list[int] = []
    batch = list(exchanges)
    for mode in (Mode.REALWORLD, Mode.IN_BETWEEN):
        mine = [e for e in batch if as_mode(e.mode) is mode]
        if mine:
            specs = [s for e in mine for s in exchange_specs(e, agent.memory.max_chars)]
            ids += agent.add(specs, mode)
    return ids


class IndexerClosed(NimmerError):
    """An exchange submitted to a :class:`TranscriptIndexer` after ``close()``."""


class TranscriptIndexer:
    """Indexes submitted exchanges on a daemon thread, in batches; ``lags_s`` records, per
    exchange, the seconds from submit to commit.

    A batch is indexed one transaction per mode; one that fails is indexed again one exchange at
    a time, so only a bad exchange is lost; an exchange that fails alone is tried up to ``tries``
    times with a doubling pause (a transient fault: an embedder error, a busy store), unless the
    store refused its content (:class:`InvalidEntry`, which another try cannot change). An
    in-between exchange whose clasp store another opener holds (:class:`ClaspBusy`, e.g. the
    runtime's memory on the same folder) waits in ``waiting``, tried again every ``wait_s``
    seconds and at :meth:`close`. What is given up is logged with the reason and kept in
    ``dropped`` as (session and turn ids, reason). After :meth:`close`, :meth:`submit` raises
    :class:`IndexerClosed` and :meth:`flush` returns at once.
    """

    def __init__(
        self,
        agent: CrystalStore,
        batch: int = 64,
        tries: int = 3,
        backoff_s: float = 0.2,
        wait_s: float = 5.0,
    ) -> None:
        self.agent, self.batch, self.tries, self.backoff_s = agent, batch, tries, backoff_s
        self.wait_s = wait_s
        self.queue: queue.Queue[Exchange | None] = queue.Queue()
        self.lags_s: list[float] = []
        self.dropped: list[tuple[str, str]] = []
        self.waiting: list[Exchange] = []  # in-between exchanges whose clasp store is open elsewhere
        self.closed = threading.Event()
        self._submitting = threading.Lock()  # no exchange slips in behind close()'s end marker
        self.thread = threading.Thread(target=self._run, name="transcript-indexer", daemon=True)
        self.thread.start()

    def submit(self, exchange: Exchange) -> None:
        with self._submitting:
            if self.closed.is_set():
                raise IndexerClosed(
                    f"transcript indexer of {self.agent.folder} is closed; exchange "
                    f"{exchange.label()} not indexed (submit before close())"
                )
            self.queue.put(exchange)

    def backlog(self) -> int:
        return self.queue.qsize()

    def _run(self) -> None:
        while True:
            try:
                first = self.queue.get(timeout=self.wait_s if self.waiting else None)
            except queue.Empty:
                self._retry_waiting(final=False)
                continue
            if first is None:
                self._retry_waiting(final=True)
                self.queue.task_done()
                return
            items = [first]
            while len(items) < self.batch:
                try:
                    more = self.queue.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self.queue.put(None)
                    self.queue.task_done()
                    break
                items.append(more)
            try:
                self._index(items)
            except Exception:  # noqa: BLE001 - never stop the thread (the exchanges are accounted)
                log.exception("transcript indexer: unexpected failure on %d exchanges", len(items))
            finally:
                for _ in items:
                    self.queue.task_done()

    def _index(self, items: list[Exchange]) -> None:
        for mode in Mode:  # one transaction per mode: a retry never repeats the other mode's part
            group = [e for e in items if e.mode is mode]
            if group:
                self._index_group(group)

    def _index_group(self, items: list[Exchange]) -> None:
        try:
            index_exchanges(self.agent, items)
            self._done(items)
            return
        except Exception as exc:  # noqa: BLE001 - tried again below, one exchange at a time
            failed = exc
        if len(items) == 1:  # the batch was this exchange's first try
            self._index_one(items[0], 1, failed)
            return
        log.warning("indexing %d exchanges together failed (%s); one at a time now", len(items), failed)
        for exchange in items:
            self._index_one(exchange, 0, None)

    def _index_one(
        self,
        exchange: Exchange,
        tried: int,
        last: Exception | None,
        waited: bool = False,
        final: bool = False,
    ) -> None:
        """Try ``exchange`` alone until ``tries`` tries in all; a refused content is not retried,
        and one whose clasp store is open elsewhere waits (unless ``final``: at close)."""
        for attempt in range(tried, self.tries):
            if isinstance(last, NimmerError):  # refused (InvalidEntry, ...) or busy: not now
                break
            if attempt:
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                index_exchanges(self.agent, [exchange])
                self._done([exchange])
                return
            except Exception as exc:  # noqa: BLE001 - a transient fault: tried again
                last = exc
        if isinstance(last, ClaspBusy) and not final:
            if not waited:  # said once, when it starts waiting
                log.warning("transcript exchange %s waits for the clasp store: %s", exchange.label(), last)
            self.waiting.append(exchange)
            return
        reason = f"{type(last).__name__}: {last}"
        tries = (
            "its clasp store stayed open elsewhere until close"
            if isinstance(last, ClaspBusy)
            else "refused by the store"
            if isinstance(last, NimmerError)
            else f"after {self.tries} tries"
        )
        log.error("transcript exchange %s not indexed (%s): %s", exchange.label(), tries, reason)
        self.dropped.append((exchange.label(), reason))

    def _retry_waiting(self, final: bool) -> None:
        waiting, self.waiting = self.waiting, []
        for exchange in waiting:
            self._index_one(exchange, 0, None, waited=True, final=final)

    def _done(self, items: list[Exchange]) -> None:
        done = time.monotonic()
        self.lags_s += [done - e.enqueued for e in items]

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything submitted so far is indexed, given up (see ``dropped``) or
        waiting for the clasp store (see ``waiting``). Returns False, without waiting further,
        once the indexer is closed and its thread has ended with exchanges left, or when
        ``timeout`` seconds pass; True when all are done and none is waiting."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.queue.all_tasks_done:
            while self.queue.unfinished_tasks:
                if self.closed.is_set() and not self.thread.is_alive():
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    return False
                self.queue.all_tasks_done.wait(0.1)
        return not self.waiting

    def close(self, timeout: float = 60) -> None:
        """Refuse new exchanges, index the ones already queued and the waiting ones (dropped if
        their clasp store is still open elsewhere), and end the thread (waiting up to ``timeout``
        seconds for it). A second close does nothing."""
        with self._submitting:
            if self.closed.is_set():
                return
            self.closed.set()
            self.queue.put(None)
        self.thread.join(timeout=timeout)
