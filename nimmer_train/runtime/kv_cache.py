"""The engine's KV cache: transformers' ``DynamicCache`` whose full-attention layers keep their keys
and values in buffers with room to grow, so a decode step writes its position in place.

``DynamicLayer`` concatenates every layer's whole cache with the new position at every step
(``torch.cat``): a copy of batch x heads x length x head_dim per layer, the largest cost that grew
with the batch (on the small base at a batch of 8 and ~400 positions, 1.8 of the 21 ms a step
took; attention over the buffer's view costs 10 % more than over a packed tensor, 0.1 ms).
Everything else about the layer is transformers' own: code that assigns ``layer.keys``
(``batch_select_indices``, ``crop``) gets a fresh buffer with room.

A **ragged step** (:class:`Ragged`) runs the running rows' next tokens and the prompts joining the
batch as one flattened sequence: the engine lays the joining rows' cached prefixes out with
:meth:`GrowingLayer.extend`, and each layer's update writes every token at its row and column.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

ROOM = 64  # positions of room a buffer is given past what it holds
ROW_ROOM = 4  # rows of room a buffer built for joining rows is given past what it holds


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


class _Store:
    """A buffer ``[capacity rows, heads, capacity positions, dim]`` whose first ``rows`` rows and
    positions ``lo`` to ``hi`` hold the layer's keys (or values)."""

    __slots__ = ("buf", "rows", "lo", "hi")

    def __init__(self, buf: torch.Tensor, rows: int, lo: int, hi: int) -> None:
        self.buf, self.rows, self.lo, self.hi = buf, rows, lo, hi

    def view(self) -> torch.Tensor:
        return self.buf[: self.rows, :, self.lo : self.hi]


def _with_room(x: torch.Tensor | None, dtype: torch.dtype | None) -> _Store | None:
    """A store (in ``dtype``, None: ``x``'s) holding ``x`` ``[batch, heads, length, dim]`` with
    room to grow (None for no tensor: transformers' lazy initialisation sets an empty 1-D one)."""
    if x is None or x.dim() != 4:
        return None
    batch, heads, length, dim = x.shape
    buffer = x.new_empty(batch, heads, length + ROOM, dim, dtype=dtype or x.dtype)
    buffer[:, :, :length].copy_(x)
    return _Store(buffer, batch, 0, length)


class GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` whose ``keys`` and ``values`` are views of buffers with room to grow,
    in rows and positions, stored in ``dtype`` (None: as they come). Keys and values keep their
    own stores: callers assign one and then compute the other from its old value (``crop``).

    The engine's batch changes in place where the room allows: :meth:`extend` writes only the
    joining rows (the running rows stay where they are, a decode column free to their right),
    :meth:`keep_rows` moves only the rows below a leaving one and trims the padding no row needs
    by moving the window's left edge. Each copied the whole cache before (on SmolLM2 at a batch
    of 8, ~10-20 ms a join and ~9 ms a leave, a fifth of a decode step each)."""

    def __init__(self, dtype: torch.dtype | None = None, **kwargs: Any) -> None:
        self._k: _Store | None = None
        self._v: _Store | None = None
        self.store = dtype
        self.ragged: Ragged | None = None  # set by the engine around a ragged forward
        super().__init__(**kwargs)

    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._k is None else self._k.view()

    @keys.setter
    def keys(self, x: torch.Tensor | None) -> None:
        self._k = _with_room(x, self.store)

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return None if self._v is None else self._v.view()

    @values.setter
    def values(self, x: torch.Tensor | None) -> None:
        self._v = _with_room(x, self.store)

    def join(self, other: GrowingLayer, width: int) -> None:
        """Append ``other``'s rows below this layer's, each side's positions right-aligned in
        ``width`` and zeros to their left (the padding the attention mask hides)."""
        assert other._k is not None
        self.extend([(other.keys, other.values, other._k.rows, width)], width, own_end=width)

    def extend(
        self,
        parts: list[tuple[Any, Any, int, int]],
        width: int,
        own_end: int,
        like: torch.Tensor | None = None,
    ) -> None:
        """Make this layer ``width`` positions wide, its own rows' positions ending at column
        ``own_end``, and append ``parts`` below them, each ``(keys, values, rows, end)``: ``rows``
        rows (keys and values broadcast to them; None when nothing is cached) whose positions end
        at column ``end``. Zeros to the left of every row's positions; the columns from its end
        to ``width`` are left for the next update to write (a ragged step's). In place when the
        buffers have the room, else in new ones with room. ``like``: a ``[.., kv_heads, .., dim]``
        tensor of the dtype to store, for a layer still empty."""
        shaped = next((p[0] for p in parts if p[0] is not None), None)
        if shaped is None:
            shaped = self._k.buf if self._k is not None else like
        assert shaped is not None, "extend needs a tensor of the cache's shape"
        if not self.is_initialized:  # transformers' bookkeeping (it empties the stores: kept)
            stores = self._k, self._v
            self.lazy_initialization(shaped[:0], shaped[:0])
            self._k, self._v = stores
        for i, name in ((0, "_k"), (1, "_v")):
            own: _Store | None = getattr(self, name)
            rows = own.rows if own is not None else 0
            total = rows + sum(p[2] for p in parts)
            if own is not None:
                lo = own.hi - own_end  # the window's new left edge
                fits = lo >= 0 and lo + width <= own.buf.shape[2] and total <= own.buf.shape[0]
                if fits:
                    own.buf[:rows, :, lo : own.lo].zero_()
                    out, at = own.buf, rows
                else:  # a new buffer: the own rows copied, right-aligned at own_end
                    lo, at = 0, rows
                    dtype = own.buf.dtype
                    out = own.buf.new_empty(
                        total + ROW_ROOM, own.buf.shape[1], width + ROOM, own.buf.shape[3]
                    )
                    n = own.hi - own.lo
                    out[:rows, :, : own_end - n].zero_()
                    out[:rows, :, own_end - n : own_end].copy_(own.view())
            else:
                dtype = self.store or shaped.dtype
                lo, at = 0, 0
                out = shaped.new_empty(
                    total + ROW_ROOM, shaped.shape[1], width + ROOM, shaped.shape[3], dtype=dtype
                )
            for part in parts:
                source, count, end = part[i], part[2], part[3]
                n = 0 if source is None else source.shape[2]
                out[at : at + count, :, lo : lo + end - n].zero_()
                if n:
                    out[at : at + count, :, lo + end - n : lo + end].copy_(source)
                at += count
            setattr(self, name, _Store(out, total, lo, lo + width))

    def keep_rows(self, index: list[int], start: int) -> None:
        """Keep the rows ``index`` (ascending) in that order and drop the first ``start``
        positions (padding no kept row needs): rows move up only below a dropped one."""
        for own in (self._k, self._v):
            assert own is not None
            own.lo += start
            for i, row in enumerate(index):
                if row != i:
                    own.buf[i, :, own.lo : own.hi].copy_(own.buf[row, :, own.lo : own.hi])
            own.rows = len(index)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.ragged is not None:
            return self._scatter(self.ragged, key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        k, v = self._k, self._v
        if k is None or v is None:
            self.keys, self.values = key_states, value_states
            return self.keys, self.values  # type: ignore[return-value]
        add = key_states.shape[2]
        fits = (
            k.hi + add <= k.buf.shape[2]
            and v.hi + add <= v.buf.shape[2]
            and (k.lo, k.hi, k.rows) == (v.lo, v.hi, v.rows)
            and key_states.shape[0] == k.rows
        )
        if fits:
            k.buf[: k.rows, :, k.hi : k.hi + add].copy_(key_states)
            v.buf[: v.rows, :, v.hi : v.hi + add].copy_(value_states)
            k.hi += add
            v.hi += add
        else:  # out of room: a new buffer (both computed before either is assigned)
            keys = torch.cat([self.keys, key_states], dim=2)  # type: ignore[list-item]
            values = torch.cat([self.values, value_states], dim=2)  # type: ignore[list-item]
            self.keys, self.values = keys, values
        return self.keys, self.values  # type: ignore[return-value]

    def _scatter(
        self, plan: Ragged, key_states: torch.Tensor, value_states: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a ragged step's ``[1, kv_heads, tokens, dim]`` keys and values where ``plan`` says
        (the stores were laid out by :meth:`extend` for it, ``plan.width`` wide)."""
        for own, new in ((self._k, key_states), (self._v, value_states)):
            assert own is not None and own.hi - own.lo == plan.width
            window = own.buf[:, :, own.lo : own.hi]
            if plan.rows:
                window[: plan.rows, :, plan.width - 1].copy_(new[0, :, : plan.rows].transpose(0, 1))
            at = plan.rows
            for seg in plan.segments:
                window[seg.row : seg.row + seg.n, :, plan.width - seg.tokens :].copy_(
                    new[:, :, at : at + seg.tokens]
                )
                at += seg.tokens
        return self.keys, self.values  # type: ignore[return-value]


def growing_cache(config: Any, dtype: torch.dtype | None = None) -> DynamicCache:
    """``DynamicCache(config=config)`` with its full-attention layers growing in place, their keys
    and values stored in ``dtype`` (None: the model's; another dtype needs an attention that takes
    it, as runtime/decode_attention.py's does; sliding window and other special layers stay
    transformers' own)."""
    cache = DynamicCache(config=config)
    cache.layers = [GrowingLayer(dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache
