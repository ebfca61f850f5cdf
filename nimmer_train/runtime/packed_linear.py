"""Linear layers served through oneDNN with their weights prepacked (CPU inference only).

``torch.nn.functional.linear`` on a CPU float32 tensor runs MKL's ``sgemm``, which packs the
weight again at every call and is slowest exactly where a decode step lives: a few rows against a
large weight. oneDNN on a weight reordered once into its blocked layout (what ``torch.compile``'s
freezing does on CPU, here without compiling anything) was 2-3x faster for those shapes on this
machine (SmolLM2-135M's MLP weight, one thread: 1 row 0.17 ms against 0.34, 8 rows 0.22 against
0.53; its 49k-token output layer at 8 rows 6.6 ms against 20-24) and as fast or faster for a
prefill's hundreds of rows, in float32 and in bfloat16, with each row's result independent of the
batch around it. The packed copy sits beside the weight, which stays the parameter every other
path (training, PEFT's adapter loads, state dicts) reads: serving memory for the linear layers'
weights doubles. Autograd is not supported by the packed kernel, so a forward with gradients
enabled takes the plain path; a weight changed since it was packed (replaced, another dtype, or
written in place so that its version counter moved) is packed again at its next forward. A write
through ``weight.data`` moves no counter (PEFT's ``merge_adapter`` writes so): call
:func:`pack_linears` again after one. The packs live in a side table, not on the modules, so a
packed model deep-copies (PEFT's ``modules_to_save``) and its copies pack themselves when used.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import torch

PACKABLE = (torch.float32, torch.bfloat16)
_PACKS: weakref.WeakKeyDictionary[torch.nn.Linear, tuple[tuple[Any, ...], torch.Tensor]] = (
    weakref.WeakKeyDictionary()
)


def packing_available() -> bool:
    """Whether this torch build has oneDNN and its prepacked linear kernel."""
    ops = torch.ops.mkldnn
    return torch.backends.mkldnn.is_available() and all(
        hasattr(ops, name) for name in ("_reorder_linear_weight", "_linear_pointwise")
    )


def pack_linears(model: Any) -> int:
    """Route each ``torch.nn.Linear`` of ``model`` whose weight is on the CPU in float32 or
    bfloat16 through a prepacked oneDNN kernel; how many were packed (0 where oneDNN is missing,
    or cannot pack bfloat16 on this CPU: those layers keep the plain path)."""
    if not packing_available():
        return 0
    count = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        weight = module.weight
        if weight.device.type != "cpu" or weight.dtype not in PACKABLE:
            continue
        if _pack(module) is None:
            continue
        module.forward = types.MethodType(_packed_forward, module)
        count += 1
    return count


def _key(weight: torch.Tensor) -> tuple[Any, ...]:
    try:
        version = weight._version
    except RuntimeError:  # an inference tensor: it has no version counter
        version = -1
    return weight.data_ptr(), version, weight.dtype


def _pack(module: torch.nn.Linear) -> torch.Tensor | None:
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), None)
    except RuntimeError:  # e.g. bfloat16 on a CPU without AVX512 (oneDNN's low-precision check)
        _PACKS.pop(module, None)
        return None
    _PACKS[module] = (_key(module.weight), packed)
    return packed


def _packed_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    weight = self.weight
    plain = torch.is_grad_enabled() or x.device.type != "cpu" or weight.device.type != "cpu"
    if plain or x.dtype != weight.dtype or weight.dtype not in PACKABLE:
        return torch.nn.functional.linear(x, weight, self.bias)
    key, packed = _PACKS.get(self, (None, None))
    if key != _key(weight):
        packed = _pack(self)
        if packed is None:
            return torch.nn.functional.linear(x, weight, self.bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, self.bias, "none", [], "")
