"""The serving engine's attention on the CPU: transformers' SDPA, with two costs taken out.

- **One query token** (every decode step): scores, softmax and the weighted sum as two batched
  matmuls on the key/value heads (each key/value head's query heads side by side, no
  ``repeat_kv``), in float32. On SmolLM2-135M's shapes at a batch of 8 with padded rows this made
  a float32 step 2 ms (3 %) faster than SDPA.
- **bfloat16**: torch's CPU flash attention ran 6x slower in bfloat16 than in float32 (1.27 ms
  against 0.20 for the same decode step), so attention runs in float32 whatever the weights'
  dtype; the engine stores the KV cache in float32 (no cast of the cache at each step), queries
  are upcast and the output cast back. A prefill (several query tokens) takes SDPA in float32.

- **A ragged step** (``ragged=`` :class:`~nimmer_train.runtime.kv_cache.Ragged` in the forward's
  keyword arguments): the running rows' next tokens and the prompts joining the batch come as one
  flattened sequence; the running rows attend as above, each joining prompt causally over its own
  row (SDPA in float32). One forward then reads the weights once for both, where a separate
  prefill read them again (vLLM's and Sarathi's mixed prefill-decode batches).

Registered with transformers as ``"nimmer_sdpa"`` (attention and mask functions) and selected by
:func:`use_decode_attention` on a serving model that runs SDPA (a model on eager attention for a
softcap, or without SDPA support, keeps its own); training keeps transformers' own.
"""

from __future__ import annotations

from typing import Any

import torch

NAME = "nimmer_sdpa"


def decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q, dim]
    key: torch.Tensor,  # [batch, kv_heads, length, dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,  # SDPA's: bool (True attends) or additive float, or None
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    dtype = query.dtype
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if kwargs.get("ragged") is not None:
        return _ragged(query, key, value, kwargs["ragged"], scale), None
    if query.shape[2] != 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("softcap"):
        if dtype == torch.float32 or query.device.type != "cpu":
            return sdpa_attention_forward(
                module, query, key, value, attention_mask, dropout, scaling, **kwargs
            )
        mask = attention_mask
        if mask is not None and mask.dtype != torch.bool:
            mask = mask.float()
        out, _ = sdpa_attention_forward(
            module, query.float(), key.float(), value.float(), mask, dropout, scaling, **kwargs
        )
        return out.to(dtype), None
    mask = None if attention_mask is None else attention_mask[:, :, -1:, :]  # the one query's row
    return _one_query(query, key, value, mask, scale), None


def _one_query(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    """Each row's single query token over its keys: ``[batch, 1, heads, dim]`` in ``query``'s
    dtype; ``mask`` ``[batch or 1, 1, 1, length]``, bool (True attends) or additive."""
    batch, heads, _, dim = query.shape
    groups = key.shape[1]
    q = query.reshape(batch, groups, heads // groups, dim).float()  # a key head's query heads as rows
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [batch, groups, rep, length]
    if mask is not None:
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value.float())  # [batch, groups, rep, dim]
    return out.reshape(batch, 1, heads, value.shape[-1]).to(query.dtype)


def _ragged(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, plan: Any, scale: float
) -> torch.Tensor:
    """A ragged step's attention (``plan``: kv_cache.Ragged): ``query`` ``[1, heads, tokens, dim]``
    over the batch's ``[rows, kv_heads, width, dim]`` keys; ``[1, tokens, heads, dim]``."""
    parts, width = [], plan.width
    if plan.rows:
        q = query[0, :, : plan.rows].transpose(0, 1).unsqueeze(2)  # [rows, heads, 1, dim]
        out = _one_query(q, key[: plan.rows], value[: plan.rows], plan.decode_mask, scale)
        parts.append(out.reshape(1, plan.rows, *out.shape[2:]))
    at = plan.rows
    for seg in plan.segments:
        q = query[:, :, at : at + seg.tokens].float()
        k = key[seg.row : seg.row + 1, :, width - seg.length : width].float()
        v = value[seg.row : seg.row + 1, :, width - seg.length : width].float()
        causal = torch.ones(seg.tokens, seg.length, dtype=torch.bool).tril(seg.length - seg.tokens)
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=causal, scale=scale, enable_gqa=k.shape[1] != q.shape[1]
        )
        parts.append(out.transpose(1, 2).to(query.dtype))
        at += seg.tokens
    return torch.cat(parts, dim=1)


def use_decode_attention(model: Any) -> bool:
    """Switch ``model`` (a transformers model, or a PEFT model around one) to this attention where
    it runs transformers' SDPA now; whether it did. A model on another attention (eager for a
    softcap, or one without SDPA support, which may pass sinks or biases SDPA ignores) keeps it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if inner.config._attn_implementation != "sdpa":
        return inner.config._attn_implementation == NAME
    AttentionInterface.register(NAME, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    inner.config._attn_implementation = NAME
    return True


RAGGED_MODEL_TYPES = frozenset({"llama"})  # forwards that hand their keyword arguments to attention


def takes_ragged(model: Any) -> bool:
    """Whether ``model`` (switched by :func:`use_decode_attention`) runs a ragged step: its
    attention is this one and its architecture passes ``ragged=`` through (tests/unit/runtime
    compare the step with a prefill of its own for each listed one)."""
    config = model.config
    return config._attn_implementation == NAME and config.model_type in RAGGED_MODEL_TYPES
