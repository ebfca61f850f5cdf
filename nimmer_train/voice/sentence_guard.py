"""The sentence guard: no sentence said more than ``max_sentence_repeats`` times in one reply,
held while decoding (the voice bar's no-repeat check, :func:`quality.repeats_sentence`, measured
after the fact).

The n-gram guard cannot do this: a drunk scavenger's "Ha! Ha! You missed a coil. Ha!" repeats a
two-token sentence with other words between, which only a 2-gram guard would catch, and a 2-gram
guard forbids half of English. So the guard reads the reply as the check does and bans a token
that would end a sentence whose words (:func:`quality.words`) the reply has said ``limit`` times
already: at a mark of :data:`quality.SENTENCE_END`, or where the text ends.

- The reply is read as bytes, as the tokenizer's decode reads them (byte-level BPE: every token's
  bytes; UTF-8 decoded incrementally), so a character split over tokens is read once it is whole
  and a token may end one character and hold a mark, or hold a mark and begin a character.
- A structured reply (a JSON schema's grammar) is read as JSON: each string value is its own text
  (the check reads the utterance's), escapes decoded (``\\n`` and ``\\u000a`` are line breaks,
  ``\\"`` a quote), ending at its closing quote; keys and the other fields never count with it.
  A free reply is one text that ends at the end-of-turn token.
- Where the grammar allows only banned tokens (the token budget closing a reply mid-sentence),
  the grammar wins, as it does over the n-gram guard.
- Not covered: a token that ends two sentences (only its first end is read; a byte-level
  vocabulary has none, its pre-tokenizer splits letters from marks), and a free reply a client's
  ``stop`` string cuts (the guard knows the end-of-turn token only).

Cheap by construction: the reply is read incrementally, and while no sentence has reached the
limit (nearly every step) a row costs the reading of its new token; past it, only the tokens whose
text before its first mark spells exactly the letters the sentence still lacks are checked word by
word, each text once and only its last word re-read. In the rare states where a token's meaning
depends on what came before (an escape or a character begun), the tokens that could continue it
are read one by one."""

from __future__ import annotations

import codecs
import copy
import functools
import re
import threading
import unicodedata
import weakref
from collections import Counter, defaultdict
from typing import Any

import regex

from nimmer_train.voice.quality import SENTENCE_END, words

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", '"': '"', "\\": "\\", "/": "/"}
HEX = "0123456789abcdefABCDEF"
LONG, NEAR = 256, 64  # a run without white space longer than LONG is re-read from NEAR before its end
BREAKING = '.!?\u2026\n"\\'  # what may end a sentence in a JSON string (a mark, a quote, an escape)
Sentence = tuple[str, ...]
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
PREPEND = regex.compile(r"\p{Grapheme_Cluster_Break=Prepend}")
WHITE = " \t\r"  # what ends a word (and a prepend's cluster takes in)


def _letters(text: str) -> str:
    """The letters of ``text``'s :func:`words`, run together (what a sentence must spell)."""
    return "".join(c for w in words(text) for c in w if c.isalpha())


def token_bytes(tokenizer: Any) -> list[bytes]:
    """Each token's bytes as the tokenizer's decode joins them (skip_special_tokens: a special
    token adds none). Byte-level BPE maps bytes to characters (GPT-2's table); SentencePiece
    writes a byte it lacks as ``<0xNN>`` and a space as U+2581; any other token is its own text."""
    added = tokenizer.added_tokens_decoder
    special = set(tokenizer.all_special_ids) | {i for i, t in added.items() if t.special}
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    table: dict[str, int] = {}
    if type(decoder).__name__ == "ByteLevel":
        printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
        table, extra = {chr(b): b for b in printable}, 0
        for b in range(256):
            if b not in printable:
                table[chr(256 + extra)], extra = b, extra + 1
    out = []
    for i, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))):
        if i in special or token is None:
            out.append(b"")
        elif i in added:
            out.append(added[i].content.encode())
        elif table and all(c in table for c in token):
            out.append(bytes(table[c] for c in token))
        elif piece := BYTE_PIECE.fullmatch(token):
            out.append(bytes([int(piece.group(1), 16)]))
        elif "\u2581" in token:
            out.append(token.replace("\u2581", " ").encode())
        else:
            out.append(tokenizer.decode([i]).encode())
    return out


@functools.cache
def composing() -> frozenset[str]:
    """The characters NFC may join to the one before them (wordfreq normalises): the second of
    every two-character canonical decomposition (the Tamil AU length mark, with combining class
    0, among them), combining marks, and Hangul's vowel and final jamo."""
    out = {chr(c) for c in range(0x1161, 0x1176)} | {chr(c) for c in range(0x11A8, 0x11C3)}
    for code in range(0x30000):  # no character above decomposes (the last is U+2FA1D)
        c = chr(code)
        if unicodedata.combining(c):
            out.add(c)
        parts = unicodedata.decomposition(c).split()
        if len(parts) == 2 and not parts[0].startswith("<"):
            out.add(chr(int(parts[1], 16)))
    return frozenset(out)


def _takes_space(text: str) -> bool:
    """``text`` (up to white space) ends in a letter that takes the white space after it into
    its word (a grapheme cluster's prepend: U+0D4E, U+0600, ...)."""
    return bool(PREPEND.match(text.rstrip(WHITE)[-1:] or "."))


class _Reader:
    """Reads a reply character by character: the sentence being said (``partial``) and, in a
    structured reply, where in the JSON it is. ``feed`` returns a sentence it ended."""

    def __init__(self, structured: bool, inside: bool | None = None) -> None:
        self.structured = structured
        self.inside = not structured if inside is None else inside  # in a text whose sentences count
        self.key = self.key_next = self.fresh = False  # in a key; the next string is one; a new text
        self.escape = ""  # a JSON escape begun and not finished
        self.stack: list[str] = []  # open JSON objects and arrays
        self.partial = ""
        self.begun = 0  # how many sentences were begun (each ended or opened string starts one)

    def feed(self, c: str) -> str | None:
        if not self.structured:
            return self._content(c)
        if self.inside or self.key:
            return self._string(c)
        if c == '"':
            self.inside, self.key = not self.key_next, self.key_next
            self.fresh, self.partial, self.begun = self.inside, "", self.begun + 1
        elif c in "{[":
            self.stack.append(c)
            self.key_next = c == "{"
        elif c in "}]":
            self.stack = self.stack[:-1]
        elif c == ",":
            self.key_next = bool(self.stack) and self.stack[-1] == "{"
        elif c == ":":
            self.key_next = False
        return None

    def _string(self, c: str) -> str | None:
        if self.escape:
            self.escape += c
            if self.escape[1] != "u":
                c, self.escape = ESCAPES.get(c, c), ""
            elif len(self.escape) < 6:
                return None
            else:  # \uXXXX (the grammar allows only valid JSON)
                code, self.escape = self.escape[2:], ""
                c = chr(int(code, 16)) if all(h in HEX for h in code) else ""
        elif c == "\\":
            self.escape = c
            return None
        elif c == '"':
            ended = self._end() if self.inside else None
            self.inside = self.key = False
            return ended
        return self._content(c) if self.inside else None

    def _content(self, c: str) -> str | None:
        if SENTENCE_END.match(c):
            return self._end()
        self.partial += c
        return None

    def _end(self) -> str:
        ended, self.partial, self.begun = self.partial, "", self.begun + 1
        return ended


class _Enders:
    """The tokens that end a sentence when read from a clean state (no escape, no character
    begun), indexed by the letters of the text each adds before it ends one."""

    def __init__(self, texts: list[str], structured: bool, ends: list[int]) -> None:
        self.by_letters: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.joining: dict[str, list[int]] = defaultdict(list)  # a combining mark first: in context
        for token, text in enumerate(texts):
            reader = _Reader(structured, inside=True)
            for c in text:
                before = reader.partial
                if reader.feed(c) is not None:
                    if before and before[0] in composing():  # may join the letter before it
                        self.joining[before].append(token)
                    else:
                        self.by_letters[_letters(before)][before].append(token)
                    break
        for token in ends:  # a free reply's end of turn ends its last sentence
            self.by_letters[""][""].append(token)


class SentenceGuard:
    """One tokenizer's tables: each token's bytes, the tokens that end a sentence (in a JSON
    string, in free text), and those that could finish an escape or a character begun."""

    def __init__(self, tokenizer: Any, stop_ids: set[int] | list[int]) -> None:
        self.raw = token_bytes(tokenizer)
        self.stops = sorted(stop_ids)
        texts = [codecs.getincrementaldecoder("utf-8")("replace").decode(b) for b in self.raw]
        self.enders = {True: _Enders(texts, True, []), False: _Enders(texts, False, self.stops)}
        # after a lone backslash: "n", "u" (\u000a), or an escape with a mark or a quote after it
        self.after_escape = [
            t
            for t, text in enumerate(texts)
            if text[:1] in ("n", "u") or (text[:1] in ESCAPES and any(c in text[1:] for c in BREAKING))
        ]
        self.after_u = [t for t, text in enumerate(texts) if text[:1] and text[0] in HEX]
        self.continuing = [t for t, b in enumerate(self.raw) if b and 0x80 <= b[0] <= 0xBF]
        self.continues = frozenset(self.continuing)

    def reply(self, limit: int, structured: bool) -> ReplySentences:
        """A tracker for one reply (``structured``: a JSON reply) that may say a sentence at most
        ``limit`` times."""
        return ReplySentences(self, limit, structured)


class ReplySentences:
    """The sentences one reply has said so far, read as its tokens arrive."""

    def __init__(self, guard: SentenceGuard, limit: int, structured: bool) -> None:
        self.guard, self.limit, self.structured = guard, limit, structured
        self._reset()

    def _reset(self) -> None:
        self.ids: list[int] = []  # the tokens read
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.reader = _Reader(self.structured)
        self.said: Counter[Sentence] = Counter()  # the current text's complete sentences
        # the current sentence's words, cached: partial[:cut] ends in white space; a long tail's split
        self.begun, self.cut, self.head, self.split = -1, 0, (), (-1, 0, ())

    def bans(self, ids: list[int]) -> set[int]:
        """The tokens that would end, as the next token after ``ids`` (the reply's own tokens), a
        sentence already said ``limit`` times."""
        if ids[: len(self.ids)] != self.ids:  # another reply's tokens: read from the start
            self._reset()
        for token in ids[len(self.ids) :]:
            self._read(token)
        full = {s for s, n in self.said.items() if n >= self.limit}
        reader = self.reader
        if not full or not reader.inside:
            return set()
        if self.decoder.getstate()[0]:  # a character begun: its next bytes, or a U+FFFD and a token
            flushed = self._enders(full, "\ufffd") - self.guard.continues
            return self._trying(self.guard.continuing, full) | flushed
        if reader.escape:
            return self._trying(
                self.guard.after_escape if reader.escape == "\\" else self.guard.after_u, full
            )
        return self._enders(full, "")

    def _read(self, token: int) -> None:
        self.ids.append(token)
        for c in self.decoder.decode(self.guard.raw[token]):
            ended = self.reader.feed(c)
            if self.reader.fresh:  # a new string value: its own sentences
                self.said, self.reader.fresh = Counter(), False
            if ended is not None and (ws := words(ended)):
                self.said[tuple(ws)] += 1
        if not self.structured and token in self.guard.stops and (ws := words(self.reader.partial)):
            self.said[tuple(ws)] += 1

    def _words(self, extra: str) -> Sentence:
        """The words of the sentence so far with ``extra`` after it, re-reading only its last
        word (a word never spans white space) and, past :data:`LONG` characters without white
        space, its last :data:`NEAR` (where splitting there reads the same words)."""
        partial, begun = self.reader.partial, self.reader.begun
        if self.begun != begun:  # another sentence: nothing cached holds
            self.begun, self.cut, self.head, self.split = begun, 0, (), (-1, 0, ())
        space = max(partial.rfind(c) for c in WHITE)
        if space + 1 > self.cut and not _takes_space(partial[: space + 1]):
            self.head += tuple(words(partial[self.cut : space + 1]))
            self.cut = space + 1
        tail = partial[self.cut :]
        if len(tail) > LONG:
            if self.split[0] != len(partial):
                at = len(tail) - NEAR
                front = tuple(words(tail[:at]))
                same = tuple(words(tail)) == front + tuple(words(tail[at:]))
                self.split = (len(partial), at if same else 0, front)
            _, at, front = self.split
            if at:
                return self.head + front + tuple(words(tail[at:] + extra))
        return self.head + tuple(words(tail + extra))

    def _enders(self, full: set[Sentence], flushed: str) -> set[int]:
        """From a clean state: the tokens whose text before its first mark completes a full one
        (``flushed``: what a pending character turns into first)."""
        said = self._words(flushed)
        have = "".join(c for w in said for c in w if c.isalpha())
        enders = self.guard.enders[self.structured]
        befores: dict[str, list[int]] = dict(enders.joining)
        for sentence in full:
            need = "".join(c for w in sentence for c in w if c.isalpha())
            if need.startswith(have):
                befores.update(enders.by_letters.get(need[len(have) :], {}))
        banned: set[int] = set()
        joins = _takes_space(self.reader.partial + flushed)
        for before, tokens in befores.items():  # white space joins no word: the sentence as it is
            if (said if not (before.strip() or joins) else self._words(flushed + before)) in full:
                banned.update(tokens)
        return banned

    def _trying(self, tokens: list[int], full: set[Sentence]) -> set[int]:
        """Each of ``tokens`` read on a copy of this state: those that end a full sentence."""
        banned, state = set(), self.decoder.getstate()
        for token in tokens:
            decoder, reader = codecs.getincrementaldecoder("utf-8")("replace"), copy.copy(self.reader)
            decoder.setstate(state)
            reader.stack = list(reader.stack)
            start = len(reader.partial)
            for c in decoder.decode(self.guard.raw[token]):
                ended = reader.feed(c)
                if ended is not None:
                    if self._words(ended[start:]) in full and ended[:start] == self.reader.partial:
                        banned.add(token)
                    break
        return banned


_GUARDS: weakref.WeakKeyDictionary[Any, SentenceGuard] = weakref.WeakKeyDictionary()
_BUILDING = threading.Lock()


def tracker(tokenizer: Any, stop_ids: Any, limit: int, structured: bool) -> ReplySentences | None:
    """One reply's tracker on ``tokenizer``'s guard (None: ``limit`` 0, off). The guard is built
    on the first guarded reply (about 0.5 s for SmolLM2) and shared by every engine after it."""
    if not limit:
        return None
    with _BUILDING:
        guard = _GUARDS.get(tokenizer)
        if guard is None:
            guard = _GUARDS[tokenizer] = SentenceGuard(tokenizer, stop_ids)
    return guard.reply(limit, structured)
