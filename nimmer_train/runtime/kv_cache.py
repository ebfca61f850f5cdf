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


def _with_room(x: torch.Tensor | None, dtype: torch.dtype | None) -> tuple[torch.Tensor | None, int]:
    """A buffer (in ``dtype``, None: ``x``'s) holding ``x`` ``[batch, heads, length, dim]`` in its
    first ``length`` positions, and ``length`` (None, 0 for no tensor: transformers' lazy
    initialisation sets an empty 1-D one)."""
    if x is None or x.dim() != 4:
        return None, 0
    batch, heads, length, dim = x.shape
    buffer = x.new_empty(batch, heads, length + ROOM, dim, dtype=dtype or x.dtype)
    buffer[:, :, :length].copy_(x)
    return buffer, length


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` and ``values`` are views of buffers with room to grow,
    stored in ``dtype`` (None: as they come). Keys and values keep their own lengths: callers
    assign one and then compute the other from its old value (the engine's sweep, ``crop``)."""

    def __init__(self, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._nk = self._nv = 0
        self.store = dtype
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k[:, :, : self._nk]

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:
        self._k, self._nk = _with_room(x, self.store)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v[:, :, : self._nv]

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:
        self._v, self._nv = _with_room(x, self.store)

    def join(self, other: GrowingLayer, width: int) -> None:
        """Append ``other``'s rows below this layer's, each side's positions right-aligned in
        ``width`` and zeros to their left (the padding the attention mask hides), in one copy."""
        for name in ("_k", "_v"):
            mine, theirs = getattr(self, name), getattr(other, name)
            mine_n, theirs_n = (self._nk, other._nk) if name == "_k" else (self._nv, other._nv)
            assert mine is not None and theirs is not None
            top, bottom = mine.shape[0], theirs.shape[0]
            out = mine.new_empty(top + bottom, mine.shape[1], width + ROOM, mine.shape[3])
            for rows, source, n in ((slice(0, top), mine, mine_n), (slice(top, None), theirs, theirs_n)):
                out[rows, :, : width - n].zero_()
                out[rows, :, width - n : width].copy_(source[:, :, :n])
            setattr(self, name, out)
        self._nk = self._nv = width

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self._k is None or self._v is None:
            self.keys, self.values = key_states, value_states
            return self.keys, self.values  # type: ignore[return-value]
        n, add = self._nk, key_states.shape[2]
        fits = n + add <= min(self._k.shape[2], self._v.shape[2]) and self._nv == n
        if fits and key_states.shape[0] == self._k.shape[0]:
            self._k[:, :, n : n + add].copy_(key_states)
            self._v[:, :, n : n + add].copy_(value_states)
            self._nk = self._nv = n + add
        else:  # out of room: a new buffer (both computed before either is assigned)
            keys = torch.cat([self.keys, key_states], dim=2)  # type: ignore[list-item]
            values = torch.cat([self.values, value_states], dim=2)  # type: ignore[list-item]
            self.keys, self.values = keys, values
        return self.keys, self.values  # type: ignore[return-value]


def growing_cache(config: Any, dtype: torch.dtype | None = None) -> DynamicCache:
    """``DynamicCache(config=config)`` with its full-attention layers growing in place, their keys
    and values stored in ``dtype`` (None: the model's; another dtype needs an attention that takes
    it, as runtime/decode_attention.py's does; sliding window and other special layers stay
    transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
