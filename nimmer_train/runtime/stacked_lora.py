"""Every register LoRA of a PEFT model applied per batch row in one pass (S-LoRA's "bmm" variant,
vLLM's CPU ``bgmv``): per LoRA linear layer the adapters' A and B (B times its scaling) are
stacked once, slot ``len(names)`` being zeros for the bare weights, and a forward computes
``base(x) + (x @ A[slot].T) @ B[slot].T`` for the whole batch, four ops whatever the number of
adapters. PEFT's own mixed batches (``adapter_names=[...]``) loop over the distinct adapters in
Python in every layer; this replaces that loop and PEFT's per-call hook registration. The PEFT
model stays the source of the weights (``load_adapter`` / ``delete_adapter``, then
:meth:`StackedLora.rebuild`) and the reference the tests compare against.

On the CPU the stacks stay in float32 whatever the base's dtype: torch's CPU batched matmuls of
these small shapes were 3x slower in bfloat16 (20 ms of a SmolLM2 step at 8 rows against 6-7 in
float32), and the low-rank term then loses nothing to rounding.

With few adapters (adapters x rank <= ``DENSE_MAX``) a mixed batch takes every adapter's A at once
instead: ``((x @ A_all) * mask) @ B_all``, the mask keeping each token's own adapter's block of the
``adapters x rank`` columns (zeros for a bare row). Two plain matmuls over a few dozen columns, and
nothing to gather when the batch changes: the per-row gather (a copy of each row's A and B in every
LoRA layer) cost 15-25 ms on SmolLM2 at 8 rows, a third of a decode step, at every join and leave.

In a ragged step (the engine's running rows and joining prompts as one flattened sequence
``[1, tokens, in]``) the first tokens are the batch rows', one each, and each joining prompt's
tokens follow on its own adapter (``select(adapters, segments)``).
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from nimmer_train.errors import NimmerError

BASE = "__base__"  # PEFT's name for a row on the bare weights
DENSE_MAX = 256  # adapters x rank up to which a mixed batch multiplies every adapter's A, masked


def lora_linears(model: Any) -> list[Any]:
    """The PEFT LoRA linear layers of ``model`` (none for a plain transformers model)."""
    from peft.tuners.lora import Linear

    return [m for m in model.modules() if isinstance(m, Linear)]


class StackedLora:
    """Installed on a PEFT model: :meth:`select` names each row's adapter before a forward."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.names: list[str] = []
        self.slots = torch.zeros(0, dtype=torch.long)  # per row; len(names) = the bare weights
        self.single: int | None = None  # every row on one slot: a plain matmul, no gather
        self.segments: list[tuple[int, int, int]] = []  # a ragged step's prompts: (slot, start, end)
        self.masks: dict[tuple[int, int], torch.Tensor] = {}  # (rank, tokens): the dense path's mask
        self.version = 0  # bumped when the rows' slots or the stacks change: gathers are redone
        self.layers = lora_linears(model)
        for layer in self.layers:
            layer.forward = types.MethodType(_stacked_forward, layer)
            layer.stacked = self
        self.rebuild()

    def rebuild(self) -> None:
        """Restack from the PEFT layers (after an adapter was loaded or deleted)."""
        self.layers = lora_linears(self.model)
        names = sorted({n for layer in self.layers for n in layer.lora_A})
        for layer in self.layers:
            if any(layer.use_dora.get(n, False) for n in layer.lora_A):
                raise NimmerError("DoRA adapters cannot be stacked; serve them one at a time")
            if not hasattr(layer, "stacked"):
                layer.forward = types.MethodType(_stacked_forward, layer)
                layer.stacked = self
            rank = max([layer.lora_A[n].weight.shape[0] for n in names if n in layer.lora_A] or [1])
            width, height = layer.base_layer.in_features, layer.base_layer.out_features
            a = torch.zeros(len(names) + 1, rank, width)
            b = torch.zeros(len(names) + 1, height, rank)
            with torch.no_grad():
                for i, n in enumerate(names):
                    if n in layer.lora_A:
                        r = layer.lora_A[n].weight.shape[0]
                        a[i, :r] = layer.lora_A[n].weight
                        b[i, :, :r] = layer.lora_B[n].weight * layer.scaling[n]
            weight = layer.base_layer.weight
            dtype = torch.float32 if weight.device.type == "cpu" else weight.dtype
            layer.stacked_a = a.to(weight.device, dtype)
            layer.stacked_b = b.to(weight.device, dtype)
            layer.dense = None  # every adapter's A side by side [in, adapters x rank], their B stacked
            if len(names) * rank <= DENSE_MAX:
                down = layer.stacked_a[:-1].reshape(len(names) * rank, width).T.contiguous()
                up = layer.stacked_b[:-1].transpose(1, 2).reshape(len(names) * rank, height).contiguous()
                layer.dense = (rank, down, up)
        self.names = names
        self.masks = {}
        self.version += 1

    def slot(self, adapter: str | None) -> int:
        if adapter is None or adapter == BASE:
            return len(self.names)
        if adapter not in self.names:
            raise NimmerError(f"no adapter {adapter!r} is loaded; loaded: {', '.join(self.names) or 'none'}")
        return self.names.index(adapter)

    def select(self, adapters: list[str | None], segments: Sequence[tuple[str | None, int]] = ()) -> None:
        """The adapter of each row of the next forward passes (None: the bare weights); with
        ``segments`` (adapter, tokens), a ragged forward: one token per row, then each segment's."""
        slots = [self.slot(a) for a in adapters]
        joining, start = [], len(slots)
        for adapter, tokens in segments:
            joining.append((self.slot(adapter), start, start + tokens))
            start += tokens
        if joining or self.segments:
            self.masks = {}
        self.segments = joining
        if slots == self.slots.tolist():
            return  # the same rows as the last step: each layer's gathered stacks still hold
        self.slots = torch.tensor(slots, dtype=torch.long)
        self.single = slots[0] if len(set(slots)) == 1 else None
        self.masks = {}
        self.version += 1

    def layout(self, tokens: int) -> list[tuple[int, int, int]]:
        """A ragged forward's segments as a layer sees them, ``tokens`` positions: all of them,
        or, past ``logits_to_keep`` (a LoRA on the output layer), one per segment (its last)."""
        rows = len(self.slots)
        if self.segments and tokens == rows + len(self.segments):
            return [(slot, rows + i, rows + i + 1) for i, (slot, _, _) in enumerate(self.segments)]
        return self.segments

    def clear_segments(self) -> None:
        """Back to one token layout per row (after a ragged forward)."""
        if self.segments:
            self.segments, self.masks = [], {}

    def mask(self, rank: int, tokens: int, dtype: torch.dtype) -> torch.Tensor:
        """The dense path's ``[tokens, adapters x rank]`` mask: ones on each token's adapter block
        (the rows' tokens, each row's ``tokens / rows`` in a row, then each segment's)."""
        mask = self.masks.get((rank, tokens))
        if mask is None:
            rows, segments = len(self.slots), self.layout(tokens)
            per_row = (tokens - sum(end - start for _, start, end in segments)) // max(1, rows)
            slots = [self.slots.repeat_interleave(per_row)]
            slots += [torch.full((end - start,), slot) for slot, start, end in segments]
            block = torch.arange(len(self.names) * rank) // rank  # the adapter of each column
            mask = (torch.cat(slots)[:, None] == block[None, :]).to(dtype)
            self.masks[(rank, tokens)] = mask
        return mask


def _stacked_forward(self: Any, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    result = self.base_layer(x, *args, **kwargs)
    stacked: StackedLora = self.stacked
    if self.dense is not None and (stacked.single is None or stacked.segments):
        rank, down, up = self.dense
        flat = x.reshape(-1, x.shape[-1]).to(down.dtype)
        low = (flat @ down).mul_(stacked.mask(rank, flat.shape[0], down.dtype))
        if result.dtype == up.dtype and result.is_contiguous():  # the base's fresh output, in place
            result.view(-1, result.shape[-1]).addmm_(low, up)
            return result
        return result + (low @ up).reshape(result.shape).to(result.dtype)
    if not stacked.segments:
        delta = _rows_delta(self, stacked, x)
        return result if delta is None else result + delta.to(result.dtype)
    flat, out, rows = x[0], result[0], len(stacked.slots)  # a ragged step: [1, tokens, features]
    if rows:
        delta = _rows_delta(self, stacked, flat[:rows, None])
        if delta is not None:
            out[:rows] += delta[:, 0].to(out.dtype)
    for slot, start, end in stacked.layout(flat.shape[0]):
        if slot != len(stacked.names):
            a, b = self.stacked_a[slot], self.stacked_b[slot]
            out[start:end] += ((flat[start:end].to(a.dtype) @ a.T) @ b.T).to(out.dtype)
    return result


def _rows_delta(self: Any, stacked: StackedLora, x: torch.Tensor) -> torch.Tensor | None:
    """The low-rank term of ``x`` ``[rows, tokens, in]``, each row on its selected slot (None:
    every row on the bare weights)."""
    bare = len(stacked.names)
    if stacked.single is not None:
        if stacked.single == bare:
            return None
        a, b = self.stacked_a[stacked.single], self.stacked_b[stacked.single]
        return (x.to(a.dtype) @ a.T) @ b.T
    if getattr(self, "gathered_version", None) != stacked.version:  # once per batch composition
        self.gathered = (  # [B, in, r], [B, r, out]
            self.stacked_a[stacked.slots].transpose(1, 2).contiguous(),
            self.stacked_b[stacked.slots].transpose(1, 2).contiguous(),
        )
        self.gathered_version = stacked.version
    a, b = self.gathered
    flat = x.to(a.dtype).reshape(x.shape[0], -1, x.shape[-1])
    return torch.bmm(torch.bmm(flat, a), b).reshape(*x.shape[:-1], -1)
