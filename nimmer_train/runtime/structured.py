"""JSON-schema-constrained decoding for the local backend, with llguidance.

llguidance (the Rust grammar engine behind vLLM's and llama.cpp's structured outputs) compiles
the turn's ``output_schema`` into a token mask computed per step in microseconds, works with any
Hugging Face fast tokenizer (our trained byte-level BPE included) and is a small wheel with no
GPU dependencies (xgrammar pulls in triton; lm-format-enforcer is pure Python and slower).
The mask is the first logits processor, so sampling knobs act only on tokens the schema allows.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

import torch
from transformers import LogitsProcessor


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=n_vocab)


@lru_cache(maxsize=64)
def _grammar(schema_json: str) -> str:
    from llguidance import LLMatcher

    return LLMatcher.grammar_from_json_schema(
        json.loads(schema_json), defaults={"whitespace_flexible": False}
    )


OPTIONAL_CHARS = 16  # optional strings (emotion, gesture) are short; the required ones get the rest


def bounded(schema: dict[str, Any], max_new_tokens: int) -> dict[str, Any]:
    """``schema`` narrowed so that a worst-case reply (one character per token) still closes
    within ``max_new_tokens``: a maxLength on each top-level string property and, when the budget
    is tight, only the required properties. Whatever it admits is valid under ``schema``. Without
    it a small model can talk past the budget inside a string and leave unclosed JSON."""
    props = schema.get("properties")
    if schema.get("type") != "object" or not isinstance(props, dict):
        return schema
    keep = list(props)
    skeleton = lambda names: 2 + sum(len(n) + 6 for n in names)  # noqa: E731 - {"k":"",...}
    strings = lambda names: [n for n in names if props[n].get("type") == "string"]  # noqa: E731
    if max_new_tokens - skeleton(keep) < 8 * max(1, len(strings(keep))):
        keep = [n for n in keep if n in schema.get("required", [])]
    budget = max_new_tokens - skeleton(keep)
    required = [n for n in strings(keep) if n in schema.get("required", [])]
    optional = [n for n in strings(keep) if n not in required]
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


class SchemaMask(LogitsProcessor):
    """Masks every token that cannot continue a JSON document valid under ``schema``."""

    def __init__(self, tokenizer: Any, schema: dict[str, Any], n_vocab: int, prompt_len: int) -> None:
        from llguidance import LLMatcher
        from llguidance.torch import allocate_token_bitmask

        self.matcher = LLMatcher(
            _ll_tokenizer(tokenizer, n_vocab), _grammar(json.dumps(schema, sort_keys=True))
        )
        if self.matcher.is_error():
            raise ValueError(f"output_schema cannot be compiled to a grammar: {self.matcher.get_error()}")
        self.prompt_len = prompt_len
        self.bitmask = allocate_token_bitmask(1, n_vocab)
        self.bits = torch.arange(32, dtype=torch.int32)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        from llguidance.torch import fill_next_token_bitmask

        if input_ids.shape[1] > self.prompt_len:
            self.matcher.consume_token(int(input_ids[0, -1]))
        fill_next_token_bitmask(self.matcher, self.bitmask)
        allowed = ((self.bitmask[0].unsqueeze(1) >> self.bits) & 1).flatten()[: scores.shape[-1]].bool()
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))
