"""The engine's KV cache: transformers' ``DynamicCache`` whose full-attention layers keep their keys
and values in buffers with room to grow, so a decode step writes its position in place.

``DynamicLayer`` concatenates every layer's whole cache with the new position at every step
(``torch.cat``): a copy of batch x heads x length x head_dim per layer, the largest cost that grew
with the batch (on the small base at a batch of 8 and ~400 positions, 1.8 of the 21 ms a step
took; attention over the buffer's view costs 10 % more than over a packed tensor, 0.1 ms).
Everything else about the layer is transformers' own: code that assigns ``layer.keys`` (the
engine's merge and sweep, ``batch_select_indices``, ``crop``) gets a fresh buffer with room.

A **ragged step** (:class:`Ragged`) runs the running rows' next tokens and the prompts joining the
batch as one flattened sequence: the engine lays the joining rows' cached prefixes out with
:meth:`GrowingLayer.place`, and each layer's update writes every token at its row and column.
"""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class Segment:
    """A prompt joining the batch: batch rows ``row`` to ``row + n`` (one prompt, ``n`` choices)
    hold its ``length`` positions right-aligned; the last ``tokens`` of them are computed now (the
    rest came from the prefix cache)."""

    row: int
    n: int
    tokens: int
    length: int


@dataclass(frozen=True)
class Ragged:
    """One forward over ``[1, rows + sum(segment tokens)]`` tokens: first one token for each of the
    batch rows ``0 .. rows - 1`` (written at column ``width - 1``), then each segment's tokens
    (written at its rows' last ``tokens`` columns). ``decode_mask``: the rows' padding,
    ``[rows, 1, 1, width]``, True where a row attends."""

    rows: int
    segments: tuple[Segment, ...]
    width: int
    decode_mask: torch.Tensor | None


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` and ``values`` are views of buffers with room to grow,
    stored in ``dtype`` (None: as they come). Keys and values keep their own lengths: callers
    assign one and then compute the other from its old value (the engine's sweep, ``crop``)."""

    def __init__(self, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None
        self._nk = self._nv = 0
        self.store = dtype
        self.ragged: Ragged | None = None  # set by the engine around a ragged forward
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
        assert self._k is not None and other._k is not None
        self.place(
            [
                (self.keys, self.values, self._k.shape[0], width),
                (other.keys, other.values, other._k.shape[0], width),
            ],
            width,
        )

    def place(
        self, parts: list[tuple[Any, Any, int, int]], width: int, like: torch.Tensor | None = None
    ) -> None:
        """New buffers of ``width`` positions (and room) holding ``parts`` one below the other, each
        ``(keys, values, rows, end)``: ``rows`` rows (keys and values broadcast to them; None when
        nothing is cached) whose positions end at column ``end``, zeros to their left. Columns from
        ``end`` to ``width`` are left for the next update to write (a ragged step's). ``like``: a
        ``[.., kv_heads, .., head_dim]`` tensor of the dtype to store (for a layer still empty)."""
        shaped = next((p[0] for p in parts if p[0] is not None), None)
        shaped = shaped if shaped is not None else like if like is not None else self._k
        assert shaped is not None, "place needs a tensor of the cache's shape"
        dtype = self.store or (self._k.dtype if self._k is not None else shaped.dtype)
        if not self.is_initialized:
            self.lazy_initialization(shaped[:0], shaped[:0])
        total = sum(p[2] for p in parts)
        for i, name in ((0, "_k"), (1, "_v")):
            out = shaped.new_empty(total, shaped.shape[1], width + ROOM, shaped.shape[3], dtype=dtype)
            top = 0
            for part in parts:
                source, rows, end = part[i], part[2], part[3]
                n = 0 if source is None else source.shape[2]
                out[top : top + rows, :, : end - n].zero_()
                if n:
                    out[top : top + rows, :, end - n : end].copy_(source)
                top += rows
            setattr(self, name, out)
        self._nk = self._nv = width

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ragged is not None:
            return self._scatter(self.ragged, key_states, value_states)
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

    def _scatter(
        self, plan: Ragged, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a ragged step's ``[1, kv_heads, tokens, dim]`` keys and values where ``plan`` says
        (the buffers were laid out by :meth:`place` for it)."""
        for buffer, new in ((self._k, key_states), (self._v, value_states)):
            assert buffer is not None and buffer.shape[2] >= plan.width
            if plan.rows:
                buffer[: plan.rows, :, plan.width - 1].copy_(new[0, :, : plan.rows].transpose(0, 1))
            at = plan.rows
            for seg in plan.segments:
                buffer[seg.row : seg.row + seg.n, :, plan.width - seg.tokens : plan.width].copy_(
                    new[:, :, at : at + seg.tokens]
                )
                at += seg.tokens
        self._nk = self._nv = plan.width
        return self.keys, self.values  # type: ignore[return-value]


def growing_cache(config: Any, dtype: torch.dtype | None = None) -> DynamicCache:
    """``DynamicCache(config=config)`` with its full-attention layers growing in place, their keys
    and values stored in ``dtype`` (None: the model's; another dtype needs an attention that takes
    it, as runtime/decode_attention.py's does; sliding window and other special layers stay
    transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
