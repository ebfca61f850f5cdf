"""JSON-schema-constrained decoding for the local backend, with llguidance.

llguidance (the Rust grammar engine behind vLLM's and llama.cpp's structured outputs) compiles
the turn's ``output_schema`` into a token mask computed per step in microseconds, works with any
Hugging Face fast tokenizer (our trained byte-level BPE included) and is a small wheel with no
GPU dependencies (xgrammar pulls in triton; lm-format-enforcer is pure Python and slower).
The mask is the first logits processor, so sampling knobs act only on tokens the schema allows.

The grammar accepts exactly the reply format the adapters were trained on
(:func:`nimmer_train.voice.prompt_dsl.render_reply`: properties in schema order, ``", "`` and
``": "``), and once the reply is complete it allows only the chat template's end-of-turn token.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch
from transformers import LogitsProcessor

from nimmer_train.errors import NimmerError
from nimmer_train.voice.prompt_dsl import REPLY_GRAMMAR_OPTIONS, render_reply
from nimmer_train.voice.registers import load_catalogue


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab, eos_token=end_of_turn_ids(tokenizer))


@lru_cache(maxsize=64)
def _grammar(schema_json: str) -> str:
    from llguidance import LLMatcher

    # the key is the schema as written: property order is part of the format (never sort_keys)
    return LLMatcher.grammar_from_json_schema(json.loads(schema_json), defaults=REPLY_GRAMMAR_OPTIONS)


_PROBE = "nimmerprobe"


def end_of_turn_ids(tokenizer: Any) -> list[int]:
    """The ids that end an assistant turn, for every decoder to stop at: the chat template's
    end-of-turn token (the special token right after an assistant message's content:
    ``<|im_end|>`` here, ``<end_of_turn>`` for Gemma), then the tokenizer's EOS (which the
    register adapters never learn to emit; kept for bare pretrained bases)."""
    ids: list[int] = []
    if tokenizer.chat_template:
        conversation = [{"role": "user", "content": "x"}, {"role": "assistant", "content": _PROBE}]
        text = tokenizer.apply_chat_template(conversation, tokenize=False)
        after = text.split(_PROBE, 1)[1] if _PROBE in text else ""
        first = tokenizer(after, add_special_tokens=False)["input_ids"][:1]
        added = set(tokenizer.get_added_vocab().values()) | set(tokenizer.all_special_ids)
        ids += [i for i in first if i in added]
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(int(tokenizer.eos_token_id))
    return ids


def reply_matcher(tokenizer: Any, schema: dict[str, Any], n_vocab: int) -> Any:
    """An llguidance matcher for replies to ``schema`` in the training format, ending with the
    chat template's end-of-turn token; a schema it cannot compile raises ValueError."""
    from llguidance import LLMatcher

    matcher = LLMatcher(_ll_tokenizer(tokenizer, n_vocab), _grammar(json.dumps(schema)))
    if matcher.is_error():
        raise ValueError(f"output_schema cannot be compiled to a grammar: {matcher.get_error()}")
    return matcher


def chars_per_token(tokenizer: Any, texts: list[str] | None = None) -> float:
    """The tokenizer's density on speech: characters per token over ``texts`` (default: every
    register's exemplar lines in the catalogue, the voices the utterances imitate)."""
    if texts is None:
        catalogue = load_catalogue()
        texts = [line for name in catalogue.names for line in catalogue.get(name).exemplars]
    ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    return sum(map(len, texts)) / max(1, sum(map(len, ids)))


OPTIONAL_CHARS = 48  # optional strings (emotion, gesture) are short phrases; the required ones get the rest
MIN_STRING_CHARS = 8  # below this per string the budget is tight: only the required properties stay


def bounded(
    schema: dict[str, Any],
    max_new_tokens: int,
    chars_per_token: float = 1.0,
    count: Callable[[str], int] | None = None,
) -> dict[str, Any]:
    """``schema`` narrowed so that a reply at the tokenizer's density (``chars_per_token`` in the
    strings, see :func:`chars_per_token`; ``count`` tokens for the fixed parts, keys and quotes,
    one per character without it) closes within ``max_new_tokens``, the end-of-turn token
    included: a maxLength on each top-level string property and, when the budget is tight, only
    the required properties. Whatever it admits is valid under ``schema``. A reply that runs
    denser than that is closed by :class:`SchemaMask` before its budget could no longer hold
    another property, what it has open (a key, a character cut after its first byte, an empty
    required string) finished first by the shortest way."""
    props = schema.get("properties")
    if schema.get("type") != "object" or not isinstance(props, dict):
        return schema
    count = count or len
    required_names = set(schema.get("required", []))
    strings = lambda names: [n for n in names if props[n].get("type") == "string"]  # noqa: E731

    def room(names: list[str]) -> int:  # characters left for the strings' contents
        skeleton = count(render_reply({n: "" for n in names}, schema)) + 1  # + end-of-turn
        return int((max_new_tokens - skeleton) * chars_per_token)

    keep = list(props)
    if room(keep) < MIN_STRING_CHARS * max(1, len(strings(keep))):
        keep = [n for n in keep if n in required_names]
    budget = max(0, room(keep))
    required = [n for n in strings(keep) if n in required_names]
    optional = [n for n in strings(keep) if n not in required_names]
    optional_len = min(OPTIONAL_CHARS, budget // (2 * max(1, len(strings(keep)))))
    required_len = max(1, (budget - optional_len * len(optional)) // max(1, len(required)))
    out = {**schema, "properties": {n: dict(props[n]) for n in keep}}
    for name in strings(keep):
        prop = out["properties"][name]
        if "enum" not in prop:
            limit = required_len if name in required else max(1, optional_len)
            prop["maxLength"] = min(
                int(prop.get("maxLength", limit)), max(limit, int(prop.get("minLength", 0)))
            )
    return out


@lru_cache(maxsize=8)
def _finishing_tokens(tokenizer: Any, n_vocab: int) -> torch.Tensor:
    """The one-byte tokens that finish whatever a reply has open without opening anything: a
    printable ASCII character but the escape ``\\``, or a UTF-8 continuation byte (a character
    cut after its first byte is completed in at most three)."""
    ll = _ll_tokenizer(tokenizer, n_vocab)
    keep = torch.zeros(n_vocab, dtype=torch.bool)
    for token in range(min(n_vocab, ll.vocab_size)):
        if ll.is_special_token(token):
            continue
        raw = ll.decode_bytes([token])
        if len(raw) == 1 and (0x20 <= raw[0] < 0x7F and raw[0] != 0x5C or 0x80 <= raw[0] < 0xC0):
            keep[token] = True
    return keep


CLOSERS = ('"}', "}")  # what ends a flat JSON object from inside a string value or after one
# start closing this many tokens before the last moment: a string may still be too short, or a
# character cut after its first byte (UTF-8: up to three bytes more before a quote is valid)
CLOSE_MARGIN = 3


class BudgetTooSmall(NimmerError):
    """A token budget that cannot hold even the smallest reply the schema admits."""


def smallest_reply_tokens(tokenizer: Any, schema: dict[str, Any]) -> int | None:
    """Tokens of the smallest valid reply to a flat object ``schema`` (its required strings at
    their minLength) with the end-of-turn token; None for another kind of schema."""
    props, required = schema.get("properties"), schema.get("required", [])
    if schema.get("type") != "object" or not isinstance(props, dict):
        return None
    if any(props.get(n, {}).get("type") != "string" or "enum" in props[n] for n in required):
        return None
    smallest = {n: "x" * max(1, int(props[n].get("minLength", 0))) for n in required}
    return len(tokenizer(render_reply(smallest, schema), add_special_tokens=False)["input_ids"]) + 1


class RowGrammar:
    """One reply's grammar state for a batched decoder: every token that cannot continue a reply
    valid under ``schema`` in the training format is masked. With ``max_new_tokens``, once the
    budget is down to what one more of the properties that may still follow would take (its key,
    an empty value and the close: the reply could not start it and still close) it forces the
    shortest close (a closing quote and brace, then the end-of-turn token) at the first token
    where one is valid, and until then only tokens that finish what is open (forced ones, then
    one-byte ones); in the last property only the close itself is kept back. A budget below the
    smallest valid reply is refused (:class:`BudgetTooSmall`). One rule for both engines. Built off
    the decode thread (compiling is the costly part); :meth:`allowed` and :meth:`consume` are
    microseconds per token."""

    def __init__(
        self, tokenizer: Any, schema: dict[str, Any], n_vocab: int, max_new_tokens: int | None = None
    ) -> None:
        from llguidance.torch import allocate_token_bitmask

        self.matcher = reply_matcher(tokenizer, schema, n_vocab)
        self.max_new_tokens = max_new_tokens
        minimum = smallest_reply_tokens(tokenizer, schema) if max_new_tokens else None
        if minimum is not None and max_new_tokens is not None and max_new_tokens < minimum:
            raise BudgetTooSmall(
                f"max_new_tokens={max_new_tokens} cannot hold the smallest schema-valid reply "
                f"({minimum} tokens with the end of turn); set runtime.max_new_tokens (or a request's "
                f"max_tokens) to at least {minimum}"
            )
        self.closers = [tokenizer(c, add_special_tokens=False)["input_ids"] for c in CLOSERS]
        encode = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
        names = list(schema.get("properties", {}))
        self.keys = [f'"{n}":' for n in names]  # how each property starts in the reply's text
        one_more = [encode(", " + render_reply({n: ""}, schema)[1:]) for n in names]
        closing = 1 + CLOSE_MARGIN + max(map(len, self.closers))  # + the end-of-turn token
        # close_from[i]: where to start closing while property i is being written
        self.close_from = [
            max([closing, *(1 + CLOSE_MARGIN + c for c in one_more[i + 1 :])]) for i in range(len(names))
        ]
        self.decode = tokenizer.decode
        self.finishing = _finishing_tokens(tokenizer, n_vocab)
        self.text, self.current = "", -1  # the reply so far; the property being written
        self.bitmask = allocate_token_bitmask(1, n_vocab)
        self.bits = torch.arange(32, dtype=torch.int32)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(token)
        if self.max_new_tokens:
            self.text += self.decode([token])
            tail = self.text[-(64 + max(map(len, self.keys), default=0)) :]  # (keys are never
            for i in range(self.current + 1, len(self.keys)):  # inside a string: quotes there
                if self.keys[i] in tail:  # are escaped)
                    self.current = i

    def allowed(self, generated: int, width: int) -> torch.Tensor:
        """The tokens allowed after ``generated`` tokens, as a bool row of ``width``."""
        from llguidance.torch import fill_next_token_bitmask

        left = self.max_new_tokens - generated if self.max_new_tokens else None
        tight = left is not None and self._tight(left)
        forced = self._closing(left) if tight else None
        if forced is None and tight:  # no close is valid yet: finish what is open by the shortest way
            forced = next(iter(self.matcher.compute_ff_tokens()), None)  # a key's rest, ": "
        if forced is not None:
            keep = torch.zeros(width, dtype=torch.bool)
            keep[forced] = True
            return keep
        fill_next_token_bitmask(self.matcher, self.bitmask)
        allowed = ((self.bitmask[0].unsqueeze(1) >> self.bits) & 1).flatten()[:width].bool()
        if tight:  # e.g. a character cut after its first byte, an empty required string
            short = allowed & self.finishing[:width]
            if bool(short.any()):
                return short
        return allowed

    def _tight(self, left: int) -> bool:
        """Whether only ``left`` tokens are too few to start another property and still close."""
        start = self.close_from[self.current] if self.current >= 0 else max(self.close_from, default=0)
        return left <= start and not self.matcher.is_accepting()

    def _closing(self, left: int) -> int | None:
        """The first token of the shortest valid close (one that leaves the reply complete) when
        only ``left`` tokens remain, one of them for the end-of-turn token; None when no close
        is valid yet."""
        for ids in sorted(self.closers, key=len):
            if len(ids) > left - 1 or self.matcher.validate_tokens(ids) < len(ids):
                continue
            probe = self.matcher.deep_copy()
            if probe.consume_tokens(ids) and probe.is_accepting():
                return ids[0]
        return None


class SchemaMask(LogitsProcessor):
    """:class:`RowGrammar` as a logits processor for a single-row HF ``generate``."""

    def __init__(
        self,
        tokenizer: Any,
        schema: dict[str, Any],
        n_vocab: int,
        prompt_len: int,
        max_new_tokens: int | None = None,
    ) -> None:
        self.grammar = RowGrammar(tokenizer, schema, n_vocab, max_new_tokens)
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids.shape[1] - self.prompt_len
        if generated > 0:
            self.grammar.consume(int(input_ids[0, -1]))
        allowed = self.grammar.allowed(generated, scores.shape[-1])
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))
