"""The sentence guard: no sentence said more than ``max_sentence_repeats`` times in one reply,
held while decoding (the voice bar's no-repeat check, :func:`quality.repeats_sentence`, measured
after the fact).

The n-gram guard cannot do this: a drunk scavenger's "Ha! Ha! You missed a coil. Ha!" repeats a
two-token sentence with other words between, which only a 2-gram guard would catch, and a 2-gram
guard forbids half of English. So the guard reads the reply as the check does and bans a token
that would end a sentence whose words (:func:`quality.words`) the reply has said ``limit`` times
already: at a mark of :data:`quality.SENTENCE_END`, or where the text ends.

- A structured reply (a JSON schema's grammar) is read as JSON: each string value is its own text
  (the check reads the utterance's), decoded (``\\n`` is a line break, ``\\"`` a quote), and it
  ends at its closing quote; keys and the other fields never count with it.
- A free reply is one text that ends at the end-of-turn token.
- A character split over tokens (the byte pieces of "…") is read once whole; a token whose text
  joins the sentence's last letter (a combining accent) is checked word by word.
- Where the grammar allows only banned tokens (the token budget closing a reply mid-sentence),
  the grammar wins, as it does over the n-gram guard.

Cheap by construction: the reply is read incrementally, and while no sentence has reached the
limit (nearly every step) a row costs one decode of its reply; past it, only the tokens whose text
before its first mark spells exactly the letters the sentence still lacks are checked word by
word, each text once."""

from __future__ import annotations

import unicodedata
from collections import Counter, defaultdict
from typing import Any

from nimmer_train.voice.quality import SENTENCE_END, words

ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "b": "\b", "f": "\f", '"': '"', "\\": "\\", "/": "/"}
PENDING = "\ufffd"  # how a decode shows a character whose bytes have not all arrived


def _letters(text: str) -> str:
    """The letters of ``text``'s :func:`words`, run together (what a sentence must spell)."""
    return "".join(c for w in words(text) for c in w if c.isalpha())


def _before_break(text: str, structured: bool) -> str | None:
    """What ``text`` (one token's, read inside the text of a sentence) adds before it ends the
    sentence, or None if it does not end one (or it is a byte piece, read in context)."""
    if PENDING in text:
        return None
    out, escape = [], False
    for c in text:
        if escape:
            if c == "n":
                return "".join(out)
            out.append(ESCAPES.get(c, c))
            escape = False
        elif structured and c == "\\":
            escape = True
        elif (structured and c == '"') or SENTENCE_END.match(c):
            return "".join(out)
        else:
            out.append(c)
    return None


class _Enders:
    """A tokenizer's tokens that end a sentence, indexed by the letters each adds before."""

    def __init__(self, texts: list[str], structured: bool, ends: list[int]) -> None:
        self.by_letters: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        self.joining: dict[str, list[int]] = defaultdict(list)  # a combining mark first: in context
        for token, text in enumerate(texts):
            before = _before_break(text, structured)
            if before is None:
                continue
            if before and unicodedata.combining(before[0]):
                self.joining[before].append(token)
            else:
                self.by_letters[_letters(before)][before].append(token)
        for token in ends:  # a free reply's end of turn ends its last sentence
            self.by_letters[""][""].append(token)


class SentenceGuard:
    """One tokenizer's tables: the tokens that end a sentence (in a JSON string, in free text),
    those that finish an escape's ``\\n``, and the byte pieces read in context."""

    def __init__(self, tokenizer: Any, stop_ids: set[int] | list[int]) -> None:
        self.tokenizer = tokenizer
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        self.enders = {True: _Enders(texts, True, []), False: _Enders(texts, False, sorted(stop_ids))}
        self.after_backslash = [t for t, text in enumerate(texts) if text.startswith("n")]
        self.pieces = [t for t, text in enumerate(texts) if PENDING in text]

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
        self.read = ""  # the reply's text read so far
        self.said: Counter[tuple[str, ...]] = Counter()  # complete sentences of the current text
        self.partial = ""  # the current sentence so far
        self.inside = not self.structured  # reading a text whose sentences count (a JSON string value)
        self.escape = ""  # a JSON escape begun and not finished
        self.stack: list[str] = []  # open JSON objects and arrays
        self.key_next, self.key = False, False  # the next string is a key; the open one is

    def bans(self, ids: list[int]) -> set[int]:
        """The tokens that would end, as the next token after ``ids`` (the reply's own tokens), a
        sentence already said ``limit`` times."""
        text = self.guard.tokenizer.decode(ids, skip_special_tokens=True)
        ready = text.rstrip(PENDING)
        if not ready.startswith(self.read):  # the decode changed what was read: read it again
            self._reset()
        for c in ready[len(self.read) :]:
            self._char(c)
        self.read = ready
        full = {s for s, n in self.said.items() if n >= self.limit}
        if not full or not self.inside or self.key:
            return set()
        if len(text) > len(ready):  # a character's bytes half arrived: "…" would end the sentence
            return self._pieces(ids, len(text) - len(ready), full)
        if self.escape == "\\":  # "\" then "n": a line break
            said = tuple(words(self.partial)) in full
            return set(self.guard.after_backslash) if said else set()
        if self.escape:
            return set()
        return self._enders(full)

    def _enders(self, full: set[tuple[str, ...]]) -> set[int]:
        enders = self.guard.enders[self.structured]
        have = _letters(self.partial)
        befores: dict[str, list[int]] = dict(enders.joining)
        for sentence in full:
            need = "".join(c for w in sentence for c in w if c.isalpha())
            if need.startswith(have):
                befores.update(enders.by_letters.get(need[len(have) :], {}))
        banned: set[int] = set()
        said = tuple(words(self.partial))
        for before, tokens in befores.items():  # white space joins no word: the sentence as it is
            if (said if not before.strip() else tuple(words(self.partial + before))) in full:
                banned.update(tokens)
        return banned

    def _pieces(self, ids: list[int], pending: int, full: set[tuple[str, ...]]) -> set[int]:
        """The byte pieces that would finish the half-arrived character as a mark."""
        if tuple(words(self.partial)) not in full:
            return set()
        decode, tail = self.guard.tokenizer.decode, ids[-4:]
        start = len(decode(tail, skip_special_tokens=True)) - pending
        return {
            t
            for t in self.guard.pieces
            if SENTENCE_END.match(decode([*tail, t], skip_special_tokens=True)[start : start + 1])
        }

    def _char(self, c: str) -> None:
        """Read one character of the reply."""
        if not self.structured:
            self._content(c)
        elif self.inside or self.key:
            self._string(c)
        elif c == '"':
            self.inside, self.key = not self.key_next, self.key_next
            if self.inside:  # a new text: its own sentences
                self.said, self.partial = Counter(), ""
        elif c in "{[":
            self.stack.append(c)
            self.key_next = c == "{"
        elif c in "}]":
            self.stack = self.stack[:-1]
        elif c == ",":
            self.key_next = bool(self.stack) and self.stack[-1] == "{"
        elif c == ":":
            self.key_next = False

    def _string(self, c: str) -> None:
        """One character inside a JSON string (a key's are read and dropped)."""
        if self.escape:
            self.escape += c
            if self.escape[1] != "u":
                c, self.escape = ESCAPES.get(self.escape[1], self.escape[1]), ""
            elif len(self.escape) == 6:  # \uXXXX (the grammar allows only valid JSON)
                code, self.escape = self.escape[2:], ""
                c = chr(int(code, 16)) if all(h in "0123456789abcdefABCDEF" for h in code) else ""
            else:
                return
        elif c == "\\":
            self.escape = c
            return
        elif c == '"':
            if self.inside:
                self._end()
            self.inside = self.key = False
            return
        if self.inside:
            self._content(c)

    def _content(self, c: str) -> None:
        if SENTENCE_END.match(c):
            self._end()
        else:
            self.partial += c

    def _end(self) -> None:
        if ws := words(self.partial):
            self.said[tuple(ws)] += 1
        self.partial = ""
