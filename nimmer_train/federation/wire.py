"""What crosses the wire: the trainable LoRA tensors of one adapter, in a fixed order, float32.

Never text, never ids: a contributor's reply is the arrays below plus one scalar array holding
its example count (scaled into SecAgg+'s quantisation range), which only ever reaches the server
summed with everyone else's. :func:`check_update` is the one validity check, used on the device
before masking and on the server for anything it can see.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # the client's SecAgg+ stages import this module; only training needs torch
    import torch

EXAMPLES_SCALE = 1024.0  # count / scale stays inside SecAgg+'s clipping range of [-8, 8]


@dataclass(frozen=True)
class AdapterSpec:
    """Names, shapes and dtype of the adapter's trainable tensors, in wire order."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype: str = "float32"

    @property
    def digest(self) -> str:
        text = "|".join(f"{n}:{s}" for n, s in zip(self.names, self.shapes, strict=True)) + self.dtype
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def nbytes(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes) * np.dtype(self.dtype).itemsize


def lora_names(model: torch.nn.Module) -> list[str]:
    """The adapter's trainable LoRA tensors, sorted, without wrapper prefixes."""
    return sorted(
        n.removeprefix("_module.") for n, p in model.named_parameters() if p.requires_grad and "lora_" in n
    )


def spec_of(model: torch.nn.Module) -> AdapterSpec:
    params = {n.removeprefix("_module."): p for n, p in model.named_parameters()}
    names = lora_names(model)
    return AdapterSpec(tuple(names), tuple(tuple(params[n].shape) for n in names))


def get_arrays(model: torch.nn.Module) -> list[np.ndarray]:
    params = {n.removeprefix("_module."): p for n, p in model.named_parameters()}
    return [params[n].detach().cpu().float().numpy().copy() for n in lora_names(model)]


def set_arrays(model: torch.nn.Module, arrays: list[np.ndarray]) -> None:
    import torch

    params = {n.removeprefix("_module."): p for n, p in model.named_parameters()}
    with torch.no_grad():
        for name, array in zip(lora_names(model), arrays, strict=True):
            params[name].copy_(torch.from_numpy(np.asarray(array, dtype=np.float32)))


def check_update(arrays: list[np.ndarray], spec: AdapterSpec) -> str | None:
    """Why ``arrays`` is not a valid adapter update for ``spec`` (None when it is)."""
    if len(arrays) != len(spec.names):
        return f"{len(arrays)} tensors, expected {len(spec.names)} ({spec.digest})"
    for name, shape, array in zip(spec.names, spec.shapes, arrays, strict=True):
        if not isinstance(array, np.ndarray):
            return f"{name}: not an array"
        if array.dtype != np.dtype(spec.dtype):
            return f"{name}: dtype {array.dtype}, expected {spec.dtype}"
        if tuple(array.shape) != shape:
            return f"{name}: shape {tuple(array.shape)}, expected {shape}"
        if not np.isfinite(array).all():
            return f"{name}: NaN or Inf values"
    return None
