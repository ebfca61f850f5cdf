"""What crosses the wire: the trainable LoRA tensors of one adapter, in a fixed order, float32.

Never text, never ids, never counts: a contributor's reply is its *contribution*, the update
(trained minus global adapter) in the arrays below plus one scalar array, the A.1 indicator
(:func:`indicator_value` for a real A.1 update, 0 for any other node), the whole vector clipped
to the clipping norm C (:func:`contribution_bound`). It only ever reaches the server summed with
everyone else's. :func:`check_update` is the one validity check, used on the device before
masking and on the server for anything it can see.
"""

from __future__ import annotations

import hashlib
import hmac
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the client's SecAgg+ stages import this module; only training needs torch
    import torch

# The A.1 indicator is A1_INDICATOR_SHARE * C; the update keeps the rest of the norm,
# sqrt(C^2 - s^2) (0.87 C). One Gaussian mechanism of sensitivity C then covers the update sum and
# the count of real A.1 updates (indicator sum / s), which the server learns exactly from the
# unmasked sum (its threshold) and releases only noised, with noise std z C / s = 2 z.
A1_INDICATOR_SHARE = 0.5
A1_UPDATE = "a1-update"  # the client's private note to its own mods; stripped before the reply
A1_RELEASED = "a1-released-rounds"  # fit-config key: the rounds the ledger released before this one
A2_METRICS = ("a2-noise", "a2-sample-rate", "a2-steps")  # the server-operated A.2 node's step
A2_TAG = "a2-claim-tag"  # its keyed tag over that step, the round and the round's nonce (a2_claim)
A2_CLAIM = (*A2_METRICS, A2_TAG)  # the only metrics a reply carries (mods.equal_weight_mod)
A2_NONCE = "a2-claim-nonce"  # fit-config key: the server's fresh nonce for this round's claims
A2_KEY_ID = "a2-claim-key-id"  # fit-config key: which claim key the server checks with (a2_key_id)
QUANTUM = "secagg-quantum"  # fit-config key: SecAgg+'s quantisation step (0 without SecAgg+)


def a2_claim_tag(key: bytes, server_round: int, nonce: str, values: tuple[Any, ...]) -> str:
    """HMAC-SHA256 under the A.2 pool's claim key (``privacy.a2_pool.claim_key``) over the
    :data:`A2_METRICS` values as sent (their reprs: the server checks the tag before it parses
    them), the round and the server's nonce for it. SuperNodes are not authenticated: the tag is
    how the server tells its own A.2 node's claim from any node's, and a tag is good for one
    round of one server run only (a replayed one names another round or nonce)."""
    text = "|".join(["nimmer-a2-claim", str(int(server_round)), nonce, *map(repr, values)])
    return hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def a2_key_id(key: bytes) -> str:
    """A public name of a claim key (a domain-separated hash): the server sends it so that the
    A.2 node trains only for a server that will account its run."""
    return hashlib.sha256(b"nimmer-a2-claim-key-id|" + key).hexdigest()[:16]


def a2_claim(
    key: bytes, server_round: int, nonce: str, step: tuple[float, float, int]
) -> dict[str, float | int | str]:
    """The A.2 node's metrics: its step (:data:`A2_METRICS`, as Python floats and an int, the
    types that cross the wire unchanged) and their tag (:data:`A2_TAG`)."""
    values = (float(step[0]), float(step[1]), int(step[2]))
    return {
        **dict(zip(A2_METRICS, values, strict=True)),
        A2_TAG: a2_claim_tag(key, server_round, nonce, values),
    }


def indicator_value(clipping_norm: float) -> float:
    return A1_INDICATOR_SHARE * clipping_norm


def secagg_quantum(clipping_range: float, quantization_range: int) -> float:
    """The width of one SecAgg+ quantisation step: [-R, R] onto integers 0..Q."""
    return 2 * clipping_range / quantization_range


def contribution_bound(clipping_norm: float, coordinates: int, quantum: float) -> float:
    """The norm a node clips its contribution (float64) to, so that what the server's sum
    receives from it, after the float32 recast and SecAgg+'s quantisation, has norm <= C.

    Derivation (flwr 1.42 ``quantize``/``dequantize``, max_weight 1 so the weight ratio is
    exactly 1): per coordinate, ``pre = (clip(v, -R, R) + R) * Q / (2R)`` is computed in float32
    (v is float32): the sum rounds by <= 2^-24 * 2R, i.e. <= 2^-24 Q = 0.25 quantum steps, the
    float32 quantiser and the product by <= 2 * 2^-24 relative, <= 0.5 steps; stochastic rounding
    then moves it by < 1 step. Dequantised (float64), each coordinate is off by < 1.75 < 2 steps
    of width ``quantum`` = 2R / Q, so the contribution moves by < 2 sqrt(D) quantum in L2 over D
    coordinates. The float32 recast of the clipped float64 vector scales its norm by at most
    1 + 2^-24. So clip to (C - 2 sqrt(D) quantum) (1 - 2^-22). This holds for Q <= 2^22 (the
    float32 steps grow with Q); with R = C and Q = 2^22 the margin is sqrt(D) C 2^-20 (2e-4 C for
    D = 50,000)."""
    margin = 2 * math.sqrt(coordinates) * quantum
    if margin >= clipping_norm - indicator_value(clipping_norm):
        raise ValueError(
            f"SecAgg+'s rounding margin {margin:.3g} for {coordinates} coordinates leaves no room under the "
            f"clipping norm {clipping_norm}; use a finer quantisation"
        )
    return (clipping_norm - margin) * (1 - 2**-22)


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
