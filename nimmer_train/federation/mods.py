"""Client-side Flower mods around the contributor's training, outermost first:

``[refusal_mod, unmask_guard_mod, secaggplus_mod, equal_weight_mod, clip_mod, validate_mod]``

- ``refusal_mod`` answers a device's refusal (``client.Refused``: it takes no part) with an
  error reply that says only ``client.REFUSAL`` and logs one line: the node drops out of the
  round as a raised exception would make it, without a traceback in the node's or the
  simulation's log;

- ``validate_mod`` refuses to send an update that is not a finite float32 tensor list shaped like
  the global adapter the server sent (the reply becomes an error: the node drops out of the
  round, and SecAgg+ recovers its masks);
- ``clip_mod`` turns the trained adapter into the node's *contribution*: the update (trained
  minus global) followed by the A.1 indicator (s = C/2 for a real A.1 update, 0 for any other
  node), the whole vector clipped to just under the clipping norm C the server's DP wrapper sends
  (``wire.contribution_bound``: the margin covers the float32 recast and SecAgg+'s rounding).
  Flower's ``fixedclipping_mod`` is not used: it clips parameters, not this vector, and divides by
  zero on the all-zero update of a contributor with no data (flwr 1.42, ``clip_inputs_inplace``);
- ``equal_weight_mod`` gives every node the weight 1 (user-level DP sums users, not examples)
  and drops every metric except the A.2 node's accounting step and its tag (``wire.A2_CLAIM``):
  no id, tier or count leaves a node in plaintext;
- ``secaggplus_mod`` (Flower's) masks the vector;
- ``unmask_guard_mod`` refuses a SecAgg+ unmask request that names a node both active and
  dropped, or this node dropped: Flower 1.42's client would send both of that node's key shares
  (its mask seed's and its masking key's), and with a threshold of them the server removes the
  node's masks and reads its update alone.

``drill_mod`` (simulation drills only, outermost) corrupts the outgoing reply of a chosen
partition and round the way a tampered client could, to show the server refuses it.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
from flwr.app import Context, Error, Message
from flwr.app.message_type import MessageType
from flwr.clientapp.typing import ClientAppCallable
from flwr.common import ndarray_to_bytes, ndarrays_to_parameters, parameters_to_ndarrays
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.compat.common import recorddict_compat as compat
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM

from nimmer_train.federation.client import REFUSAL, Refused
from nimmer_train.federation.wire import (
    A1_UPDATE,
    A2_CLAIM,
    QUANTUM,
    AdapterSpec,
    check_update,
    contribution_bound,
    indicator_value,
)

log = logging.getLogger(__name__)
FIT = "fitres"


def refusal_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    try:
        return call_next(msg, ctxt)
    except Refused:
        log.info("round %s: %s", msg.metadata.group_id or "?", REFUSAL)
        return Message(Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, REFUSAL), reply_to=msg)


def unmask_guard_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    problem = unmask_problem(msg.content.config_records.get(RECORD_KEY_CONFIGS), msg.metadata.dst_node_id)
    if problem is None:
        return call_next(msg, ctxt)
    log.warning("round %s: refusing the server's SecAgg+ unmask request: %s", msg.metadata.group_id, problem)
    refusal = Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"unmask request refused: {problem}")
    return Message(refusal, reply_to=msg)


def unmask_problem(configs: Any, node_id: int) -> str | None:
    """Why this node must not answer an unmask request, or None (also for any other message).
    For an active node the server needs the shares of its mask seed, for a dropped one those of
    its masking key, never both: both for one node unmask its update alone. A node answering
    is not dropped. SecAgg+'s stage order lets a node answer one unmask request per round (a
    refused one leaves it unanswered), so each holder gives the server one kind of share of
    every node. What no single device can see, different lists sent to different devices, is
    docs/privacy.md's to state."""
    if configs is None or configs.get(Key.STAGE) != Stage.UNMASK:
        return None
    active = set(configs.get(Key.ACTIVE_NODE_ID_LIST, []))
    dead = set(configs.get(Key.DEAD_NODE_ID_LIST, []))
    if both := sorted(active & dead):
        return f"node(s) {both} listed both active and dropped (both key shares would unmask one update)"
    if node_id in dead:
        return f"this node ({node_id}) listed as dropped while it answers"
    return None


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
    for key in (KEY_CLIPPING_NORM, QUANTUM):
        if key not in ins.config:
            raise KeyError(f"the server sent no {key}: it must run nimmer's round loop (strategy.NoisyMean)")
    sent = parameters_to_ndarrays(ins.parameters)
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    res = compat.recorddict_to_fitres(out.content, keep_input=True)
    update = [
        np.subtract(a, b, dtype=np.float64)
        for a, b in zip(parameters_to_ndarrays(res.parameters), sent, strict=True)
    ]
    a1 = bool(res.metrics.pop(A1_UPDATE, False))
    res.parameters = ndarrays_to_parameters(
        contribution(update, a1, float(ins.config[KEY_CLIPPING_NORM]), float(ins.config[QUANTUM]))
    )
    out.content = compat.fitres_to_recorddict(res, keep_input=True)
    return out


def contribution(
    update: list[np.ndarray], a1: bool, clipping_norm: float, quantum: float
) -> list[np.ndarray]:
    """``update`` ⊕ [indicator] as float32, its L2 norm <= ``wire.contribution_bound`` (< C)."""
    s = indicator_value(clipping_norm) if a1 else 0.0
    bound = contribution_bound(clipping_norm, sum(u.size for u in update) + 1, quantum)
    room = float(np.sqrt(bound**2 - s**2))  # what the update may keep beside the indicator
    norm = float(np.sqrt(sum(float(np.sum(np.square(u))) for u in update)))
    scale = min(1.0, room / norm) if norm > 0 else 1.0
    return [(u * scale).astype(np.float32) for u in update] + [np.array([s], dtype=np.float32)]


def equal_weight_mod(msg: Message, ctxt: Context, call_next: ClientAppCallable) -> Message:
    if msg.metadata.message_type != MessageType.TRAIN:
        return call_next(msg, ctxt)
    out = call_next(msg, ctxt)
    if out.has_error():
        return out
    res = compat.recorddict_to_fitres(out.content, keep_input=True)
    res.num_examples = 1
    res.metrics = {k: v for k, v in res.metrics.items() if k in A2_CLAIM}
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
