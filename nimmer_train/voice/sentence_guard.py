"""The sentence guard: no sentence said more than ``max_sentence_repeats`` times in one reply,
held while decoding (the voice bar's no-repeat check, :func:`quality.repeats_sentence`, measured
after the fact).

The n-gram guard cannot do this: a drunk scavenger's "Ha! Ha! You missed a coil. Ha!" repeats a
two-token sentence with other words between, which only a 2-gram guard would catch, and a 2-gram
guard forbids half of English. So the guard works on text: a token is banned when it would end a
sentence (a mark of :data:`BREAKS`, or the end of the reply) whose words the reply has already
said ``limit`` times. Words are :func:`quality.words`, so the guard and the check agree on what a
sentence is; the guard also breaks at the JSON reply's quotes and braces, so the utterance's
first and last sentences count as the check counts them (a quoted phrase inside an utterance is a
sentence of its own to the guard: stricter than the check, never looser).

Cheap by construction: while no sentence has reached the limit (nearly every step) a row costs
one decode of its reply; past it, only the few tokens whose text before their first mark has
exactly the letters the sentence still lacks are checked word by word."""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from nimmer_train.voice.quality import words

# quality.SENTENCE_END's marks, and the quotes and braces that open and close a JSON reply's fields
BREAKS = re.compile('[.!?\u2026\n"{}]+')


def _letters(text: str) -> str:
    """The letters of ``text``'s :func:`words`, run together (what a sentence must spell)."""
    return "".join(c for w in words(text) for c in w if c.isalpha())


class SentenceGuard:
    """One tokenizer's sentence-ending tokens, each with the text it puts before its first mark,
    indexed by that text's letters; the end-of-reply tokens end a sentence with nothing before."""

    def __init__(self, tokenizer: Any, stop_ids: set[int] | list[int]) -> None:
        self.tokenizer = tokenizer
        self.enders: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(list))
        texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
        for token, text in enumerate(texts):
            mark = BREAKS.search(text)
            if mark is not None:
                before = text[: mark.start()]
                self.enders[_letters(before)][before].append(token)
        for token in stop_ids:
            self.enders[""][""].append(int(token))

    def reply(self, limit: int) -> ReplySentences:
        """A tracker for one reply that may say a sentence at most ``limit`` times."""
        return ReplySentences(self, limit)


class ReplySentences:
    """The sentences one reply has said so far, counted as its tokens arrive."""

    def __init__(self, guard: SentenceGuard, limit: int) -> None:
        self.guard, self.limit = guard, limit
        self.said: Counter[tuple[str, ...]] = Counter()
        self.upto = 0  # the reply's text up to here is counted (complete sentences only)

    def bans(self, ids: list[int]) -> set[int]:
        """The tokens that would end, as the next token after ``ids`` (the reply's own tokens), a
        sentence already said ``limit`` times."""
        text = self.guard.tokenizer.decode(ids, skip_special_tokens=True)
        for mark in BREAKS.finditer(text, self.upto):
            if ws := words(text[self.upto : mark.start()]):
                self.said[tuple(ws)] += 1
            self.upto = mark.end()
        full = [s for s, n in self.said.items() if n >= self.limit]
        if not full:
            return set()
        partial = text[self.upto :]
        have = _letters(partial)
        banned: set[int] = set()
        for sentence in full:
            need = "".join(c for w in sentence for c in w if c.isalpha())
            if not need.startswith(have):
                continue
            for before, tokens in self.guard.enders.get(need[len(have) :], {}).items():
                if tuple(words(partial + before)) == sentence:
                    banned.update(tokens)
        return banned
