"""Client-side Flower mods around the contributor's training, outermost first:

``[secaggplus_mod, equal_weight_mod, clip_mod, validate_mod]``

- ``validate_mod`` refuses to send an update that is not a finite float32 tensor list shaped like
  the global adapter the server sent (the reply becomes an error: the node drops out of the
  round, and SecAgg+ recovers its masks);
- ``clip_mod`` clips the update to the clipping norm the server's DP wrapper sends (Flower's
  ``fixedclipping_mod``, which divides by zero on the all-zero update of a contributor with no
  data: flwr 1.42, ``clip_inputs_inplace``);
- ``equal_weight_mod`` gives every contributor the weight 1 (user-level DP averages users, not
  examples) and moves the example count into the vector, so SecAgg+ hides it in the sum;
- ``secaggplus_mod`` (Flower's) masks the vector.

``drill_mod`` (simulation drills only, outermost) corrupts the outgoing reply of a chosen
partition and round the way a tampered client could, to show the server refuses it.
"""

from __future__ import annotations

import logging

import numpy as np
from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import ndarray_to_bytes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from nimmer_train.federation.wire import EXAMPLES_SCALE, AdapterSpec, check_update

log = logging.getLogger(__name__)
FIT = "fitres"


def validate_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    sent = parameters_to_ndarrays(compat.recorddict_to_fitins(msg.content, keep_input=True).parameters)
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    update = parameters_to_ndarrays(compat.recorddict_to_fitres(out.content, keep_input=True).parameters)
    spec = AdapterSpec(tuple(map(str, range(len(sent)))), tuple(a.shape for a in sent))
    problem = check_update(update, spec)
    if problem:
        raise ValueError(f"refusing to send a malformed update: {problem}")
    return out


def clip_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    ins = compat.recorddict_to_fitins(msg.content, keep_input=True)
    if KEY_CLIPPING_NORM not in ins.config:
        raise KeyError(
            f"the server sent no {KEY_CLIPPING_NORM}: it must wrap its strategy for client-side clipping"
        )
    sent = parameters_to_ndarrays(ins.parameters)
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    res = compat.recorddict_to_fitres(out.content, keep_input=True)
    arrays = parameters_to_ndarrays(res.parameters)
    update = [np.subtract(a, b) for a, b in zip(arrays, sent, strict=True)]
    norm = float(np.sqrt(sum(float(np.sum(np.square(u, dtype=np.float64))) for u in update)))
    scale = min(1.0, float(ins.config[KEY_CLIPPING_NORM]) / norm) if norm > 0 else 1.0
    res.parameters = ndarrays_to_parameters(
        [(b + u * scale).astype(b.dtype) for b, u in zip(sent, update, strict=True)]
    )
    out.content = compat.fitres_to_recorddict(res, keep_input=True)
    return out


def equal_weight_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    res = compat.recorddict_to_fitres(out.content, keep_input=True)
    arrays = parameters_to_ndarrays(res.parameters)
    arrays.append(np.array([res.num_examples / EXAMPLES_SCALE], dtype=np.float32))
    res.parameters = ndarrays_to_parameters(arrays)
    res.num_examples = 1
    out.content = compat.fitres_to_recorddict(res, keep_input=True)
    return out


def corrupt(arrays: list[np.ndarray], fault: str) -> list[np.ndarray]:
    """``arrays`` broken the way ``fault`` says (a drill: wrong_shape, wrong_dtype, nan)."""
    first = arrays[0]
    if fault == "wrong_shape":
        return [first.reshape(-1)[:-1], *arrays[1:]]
    if fault == "wrong_dtype":
        return [first.astype(np.float16 if first.dtype.kind == "f" else np.int32), *arrays[1:]]
    if fault == "nan":
        return [
            np.full(first.shape, np.nan, dtype=first.dtype if first.dtype.kind == "f" else np.float64),
            *arrays[1:],
        ]
    return arrays


def drill_mod(fault_of: dict[int, str]):  # noqa: ANN201 - a Flower mod
    """A mod that corrupts this node's reply when ``fault_of[round]`` names a fault."""

    def mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
        out = call_next(msg, ctxt)
        if msg.metadata.message_type != MessageType.TRAIN or out.has_error():
            return out
        fault = fault_of.get(int(msg.metadata.group_id or 0))
        if fault not in ("wrong_shape", "wrong_dtype", "nan"):
            return out
        configs = out.content.config_records.get(RECORD_KEY_CONFIGS)
        if configs is not None and Key.MASKED_PARAMETERS in configs:  # SecAgg+: the masked vector
            from flwr.common import bytes_to_ndarray

            masked = [bytes_to_ndarray(b) for b in configs[Key.MASKED_PARAMETERS]]
            configs[Key.MASKED_PARAMETERS] = [
                ndarray_to_bytes(a) for a in [masked[0], *corrupt(masked[1:], fault)]
            ]
        elif f"{FIT}.parameters" in out.content.array_records:  # plain FedAvg
            res = compat.recorddict_to_fitres(out.content, keep_input=True)
            res.parameters = ndarrays_to_parameters(corrupt(parameters_to_ndarrays(res.parameters), fault))
            out.content = compat.fitres_to_recorddict(res, keep_input=True)
        else:
            return out
        log.warning("drill: this node sends a corrupted update (%s)", fault)
        return out

    return mod
