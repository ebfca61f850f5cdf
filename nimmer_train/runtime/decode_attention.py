"""The serving engine's attention on the CPU: transformers' SDPA, with two costs taken out.

- **One query token** (every decode step): scores, softmax and the weighted sum as two batched
  matmuls on the key/value heads (each key/value head's query heads side by side, no
  ``repeat_kv``), in float32. On SmolLM2-135M's shapes at a batch of 8 with padded rows this made
  a float32 step 2 ms (3 %) faster than SDPA.
- **bfloat16**: torch's CPU flash attention ran 6x slower in bfloat16 than in float32 (1.27 ms
  against 0.20 for the same decode step), so attention runs in float32 whatever the weights'
  dtype; the engine stores the KV cache in float32 (no cast of the cache at each step), queries
  are upcast and the output cast back. A prefill (several query tokens) takes SDPA in float32.

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
    batch, heads, _, dim = query.shape
    groups = key.shape[1]
    scale = scaling if scaling is not None else dim**-0.5
    q = query.reshape(batch, groups, heads // groups, dim).float()  # a key head's query heads as rows
    scores = torch.matmul(q, key.float().transpose(-1, -2)).mul_(scale)  # [batch, groups, rep, length]
    if attention_mask is not None:
        mask = attention_mask[:, :, -1:, :]  # [batch or 1, 1, 1, length]: the one query's row
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, value.float())  # [batch, groups, rep, dim]
    return out.reshape(batch, 1, heads, value.shape[-1]).to(dtype), None


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
