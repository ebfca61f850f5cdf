"""The engine's KV cache: transformers' ``DynamicCache`` whose full-attention layers keep their keys
and values in buffers with room to grow, so a decode step writes its position in place.

``DynamicLayer`` concatenates every layer's whole cache with the new position at every step
(``torch.cat``): a copy of batch x heads x length x head_dim per layer, the largest cost that grew
with the batch (on the small base at a batch of 8 and ~400 positions, 1.8 of the 21 ms a step
took; attention over the buffer's view costs 10 % more than over a packed tensor, 0.1 ms).
Everything else about the layer is transformers' own: code that assigns ``layer.keys`` (the
engine's merge and sweep, ``batch_select_indices``, ``crop``) gets a fresh buffer with room.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

ROOM = 64  # positions of room a buffer is given past what it holds


def _with_room(x: torch.Tensor | None) -> torch.Tensor | None:
    """A buffer holding ``x`` ``[batch, heads, length, dim]`` in its first ``length`` positions
    (None for no tensor or an empty one)."""
    if x is None or x.dim() != 4 or x.numel() == 0:
        return None
    batch, heads, length, dim = x.shape
    buffer = x.new_empty(batch, heads, length + ROOM, dim)
    buffer[:, :, :length].copy_(x)
    return buffer


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` and ``values`` are views of buffers with room to grow."""

    def __init__(self, **kwargs: Any) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._n = 0
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k[:, :, : self._n]

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:
        self._k = _with_room(x)
        self._n = 0 if self._k is None else x.shape[2]  # type: ignore[union-attr]

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v[:, :, : self._n]

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:  # assigned with keys: the same length
        self._v = _with_room(x)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._k is None or self._v is None:
            self.keys, self.values = key_states, value_states
        else:
            n, add = self._n, key_states.shape[2]
            if n + add > self._k.shape[2] or key_states.shape[0] != self._k.shape[0]:
                self.keys = torch.cat([self.keys, key_states], dim=2)  # type: ignore[list-item]
                self.values = torch.cat([self.values, value_states], dim=2)  # type: ignore[list-item]
            else:
                self._k[:, :, n : n + add].copy_(key_states)
                self._v[:, :, n : n + add].copy_(value_states)
                self._n = n + add
        return self.keys, self.values  # type: ignore[return-value]


def growing_cache(config: Any) -> DynamicCache:
    """``DynamicCache(config=config)`` with its full-attention layers growing in place (sliding
    window and other special layers stay transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
