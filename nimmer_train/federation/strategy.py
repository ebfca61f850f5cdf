"""The server's strategy for one round: which nodes it samples, what it sends them, what it
accepts of their replies and what it releases.

:class:`NoisyMean` is Flower's client-side-clipping DP wrapper around FedAvg made exact
DP-FedAvg (:mod:`nimmer_train.privacy.dp_fedavg`): nodes Poisson-sampled at rate q
(:class:`PoissonSampling`), the contributions summed in float64, the release threshold counted
inside the sum (the A.1 indicators), the noisy sum divided by the fixed q N. :class:`ScreeningGrid`
drops every reply the server can read that does not fit the adapter; :class:`WeightTotalSecAggPlus`
hands NoisyMean SecAgg+'s unmasked total weight, which must be one per reply. :func:`fit_config` is what
every sampled node receives. The round loop (:mod:`nimmer_train.federation.rounds`) adopts a
released update only after its spend is accounted.
"""

from __future__ import annotations

import hmac
import logging
import math
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from flwr.app import Message
from flwr.common import FitRes, Parameters, bytes_to_ndarray, parameters_to_ndarrays
from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_extract
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.secure_aggregation import secaggplus_workflow
from flwr.serverapp.grid import Grid

from nimmer_train.config.federated import SECAGG_MAX_NODES, SECAGG_QUANTIZATION_RANGE, FederatedConfig
from nimmer_train.federation.budget import mechanism_of, planned_a2
from nimmer_train.federation.wire import (
    A1_RELEASED,
    A2_CLAIM,
    A2_KEY_ID,
    A2_METRICS,
    A2_NONCE,
    A2_TAG,
    QUANTUM,
    AdapterSpec,
    a2_claim_tag,
    a2_key_id,
    check_update,
    indicator_value,
    secagg_quantum,
)
from nimmer_train.privacy.accounting import Step
from nimmer_train.privacy.dp_fedavg import entropy_rng, poisson_cohort, release_arrays

log = logging.getLogger(__name__)
FIT_PARAMS = "fitres.parameters"


def fit_config(settings: FederatedConfig, spec: AdapterSpec) -> dict[str, Any]:
    """The per-round instructions every client receives (no ids, no data): the settings' part
    (:meth:`FederatedConfig.fit_config`), the adapter's digest and SecAgg+'s quantisation step
    (the node's clipping margin; 0 without SecAgg+)."""
    quantum = (
        secagg_quantum(settings.user_dp.clipping_norm, SECAGG_QUANTIZATION_RANGE)
        if settings.secagg.enabled
        else 0.0
    )
    return {"spec-digest": spec.digest, QUANTUM: quantum, **settings.fit_config()}


@dataclass
class RoundOutcome:
    """What the strategy saw of one round (never an individual update, never an exact count)."""

    sampled: int = 0
    available: int = 0  # nodes the sampling drew from
    participants: int = 0
    accepted: bool = False  # an update was made (it is released only if the budget allows it)
    reason: str = ""
    stop: str | None = None  # a reason to stop the federation (a cohort SecAgg+ cannot sum)
    update: list[np.ndarray] | None = None  # the noisy update sum / (q N), float32
    a1_noised: float | None = None  # the noisy indicator sum / s: noised count of A.1 updates
    a2_steps: list[Step] = field(default_factory=list)  # every A.2 DP-SGD run in the sum


class NoisyMean(DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side-clipping DP wrapper around FedAvg (which builds the fit instructions;
    the wrapper adds the clipping norm), made exact DP-FedAvg (:mod:`nimmer_train.privacy.dp_fedavg`):
    nodes are Poisson-sampled at rate q (:class:`PoissonSampling`), failures and dropouts do not
    void the round, the contributions are summed in float64, the release threshold counts real A.1
    updates inside the sum, and the noisy sum is divided by the fixed q N (never the survivors),
    so a dropout costs utility, never privacy. The aggregate and the A.2 node's claimed step are
    checked before use: a claim counts only with a valid tag under ``a2_key`` (the pool's claim
    key, ``wire.a2_claim``) for this round and its nonce; any other claim is ignored, not
    accounted (SuperNodes are not authenticated: any node could claim a step). Without
    ``a2_key`` (a server that knows no A.2 pool) no claim counts.

    ``rng`` makes the generator of each round's sampling and noise: :func:`entropy_rng` (the OS's
    entropy) always in production; a test passes a seeded one to compare with the simulator.
    ``order`` lists the available node ids in population order (the simulation's partitions);
    by default they are sorted (any fixed order gives the same distribution)."""

    def __init__(
        self,
        settings: FederatedConfig,
        spec: AdapterSpec,
        fit_config: dict[str, Any],
        rng: Callable[[], np.random.Generator] = entropy_rng,
        order: Callable[[list[str]], list[str]] | None = None,
        released: Callable[[], int] = lambda: 0,
        a2_key: bytes | None = None,
    ) -> None:
        inner = FedAvg(
            fraction_fit=settings.user_dp.fraction_fit,
            fraction_evaluate=0.0,
            min_fit_clients=settings.min_participants,
            min_available_clients=settings.min_participants,
            # the user-level mechanism's z and q are in fit_config: with the rounds released so
            # far, a device computes the federation's epsilon (client.A1_MECHANISM)
            on_fit_config_fn=lambda server_round: {
                **fit_config,
                A1_RELEASED: released(),
                **self._claim_config(),
                "round": server_round,
            },
            accept_failures=True,
        )
        super().__init__(
            inner,
            settings.user_dp.noise_multiplier,
            settings.user_dp.clipping_norm,
            settings.min_participants,
        )
        self.settings, self.spec = settings, spec
        self.mechanism = mechanism_of(settings)
        self.rng, self.order = rng, order
        self.outcome = RoundOutcome()
        self.weight_total: int | None = None  # SecAgg+'s unmasked weight factor sum (WeightTotalSecAggPlus)
        self.a2_key = a2_key
        self.claim_nonce = secrets.token_hex(16)  # fresh each round (configure_fit): no tag replays

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, Any]]:
        sampling = PoissonSampling(client_manager, self.settings.user_dp.fraction_fit, self.rng(), self.order)
        self.claim_nonce = secrets.token_hex(16)
        chosen = super().configure_fit(server_round, parameters, sampling)
        self.weight_total = None
        self.outcome = RoundOutcome(
            sampled=len(chosen), available=sampling.available, reason="" if chosen else "no node was sampled"
        )
        if self.settings.secagg.enabled and len(chosen) > SECAGG_MAX_NODES:
            self.outcome.reason = self.outcome.stop = (
                f"SecAgg+ overflow: {len(chosen)} nodes sampled, but SecAgg+'s masked sum overflows its "
                f"modulus 2^32 at 1024 nodes (quantisation range 2^22 each); at most {SECAGG_MAX_NODES} "
                "per round: lower federated.user_dp.fraction_fit"
            )
            log.error("round %d does not run: %s", server_round, self.outcome.reason)
            return []
        return chosen

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[Any],
    ) -> tuple[Parameters | None, dict[str, Any]]:
        out = self.outcome
        out.participants = len(results)
        if not results:
            return self._nothing(server_round, "no contribution reached the server")
        if problem := self._weight_problem(len(results)):
            return self._nothing(server_round, f"aggregate rejected: {problem}")
        *total, indicator_sum = self._sum(results)  # the sums over the n nodes, float64
        problem = check_update([a.astype(np.float32) for a in total], self.spec)
        indicator = float(indicator_sum.reshape(-1)[0])
        s = indicator_value(self.clipping_norm)
        a1 = indicator / s  # exact, to SecAgg+'s rounding: n nodes, each off by < 2 quanta
        if problem is None and (not np.isfinite(indicator) or abs(a1 - round(a1)) > 0.25 or a1 < -0.25):
            problem = "the A.1 indicators do not sum to a whole count"
        claims = self._a2_claims(server_round, [r.metrics for _, r in results])
        a2 = planned_a2(self.settings)
        if problem is None and any(step != a2 for step in claims):
            problem = f"an A.2 accounting step other than the configured {a2}"
        if problem:
            return self._nothing(server_round, f"aggregate rejected: {problem}")
        if round(a1) < self.settings.min_participants:  # the exact count is never written anywhere
            return self._nothing(
                server_round,
                f"fewer real A.1 updates in the sum than federated.min_participants="
                f"{self.settings.min_participants}",
            )
        # (sum + N(0, (z C)^2)) / (q N) on every coordinate, the indicator included: dp_fedavg.release
        *update, a1_mean = release_arrays([*total, indicator_sum], self.mechanism, self.rng())
        out.update = [u.astype(np.float32) for u in update]
        out.a1_noised = float(a1_mean.reshape(-1)[0]) * self.mechanism.expected_cohort / s
        out.a2_steps = [a2] * len(claims)  # every A.2 run in the sum, each the configured step
        out.accepted = True
        return None, {}  # the update is adopted by _run_round after the write-ahead ledger

    def _claim_config(self) -> dict[str, str]:
        """What the round's instructions say of A.2 claims: this round's nonce and which key the
        server checks them with; nothing without a key (the A.2 node then trains nothing)."""
        if self.a2_key is None:
            return {}
        return {A2_NONCE: self.claim_nonce, A2_KEY_ID: a2_key_id(self.a2_key)}

    def _a2_claims(self, server_round: int, metrics: list[dict[str, Any]]) -> list[Step | None]:
        """The A.2 steps claimed with a valid tag for this round (None: malformed; any but the
        configured step rejects the round); a claim without one is ignored, one line says so."""
        claims = [m for m in metrics if any(k in m for k in A2_CLAIM)]
        tagged = [_a2_claim(m) for m in claims if self._tagged(server_round, m)]
        if len(tagged) < len(claims):
            log.warning(
                "round %d: an A.2 accounting claim without a valid tag is ignored (not accounted): only the "
                "server's A.2 node, holding the pool's claim key, can claim an A.2 step",
                server_round,
            )
        return tagged

    def _tagged(self, server_round: int, metrics: dict[str, Any]) -> bool:
        """Whether ``metrics`` carry the tag of their A.2 values under this server's claim key."""
        tag = metrics.get(A2_TAG)
        if self.a2_key is None or not all(k in metrics for k in A2_METRICS):
            return False
        if not isinstance(tag, str) or not tag.isascii():
            return False
        values = tuple(metrics[k] for k in A2_METRICS)
        expected = a2_claim_tag(self.a2_key, server_round, self.claim_nonce, values)
        return hmac.compare_digest(tag.encode(), expected.encode())

    def _weight_problem(self, n: int) -> str | None:
        """Under SecAgg+, why the round's total weight is not the n x Q of n replies of weight 1
        (Q: the quantisation range; each node's weight factor is round(w / max_weight x Q)).
        SecAgg+ divides the sum by that total and :meth:`_sum` multiplies by n, so any other
        total scales every update in the sum (weight 0 from one of n: n / (n - 1)) with the
        noise unchanged. The masked factors sum modulo 2^32 and n Q < 2^32 (at most
        SECAGG_MAX_NODES nodes): the total is exact and only n weights of 1 (mod 2^32) give it.
        No figure goes into the reason (it is recorded)."""
        if not self.settings.secagg.enabled:
            return None  # plain FedAvg: _sum adds the replies itself, their weights unused
        if self.weight_total is None:
            return (
                "SecAgg+ reported no total weight (the fit workflow must be strategy.WeightTotalSecAggPlus)"
            )
        if self.weight_total != n * SECAGG_QUANTIZATION_RANGE:
            return (
                "the nodes' total weight is not 1 per reply: a node reported another weight, which "
                "would scale every update in the sum"
            )
        return None

    def _sum(self, results: list[tuple[ClientProxy, FitRes]]) -> list[np.ndarray]:
        """The sum of the n contributions, float64. Under SecAgg+ every result carries the same
        unmasked mean (an exact integer sum, dequantised in float64): times n. FedAvg's average of
        plain contributions runs in float32, whose rounding lets one contribution move the sum by
        more than C (1.00001 C beside 600 others): they are summed in float64 here instead."""
        if self.settings.secagg.enabled:
            mean = parameters_to_ndarrays(results[0][1].parameters)
            return [np.asarray(a, np.float64) * len(results) for a in mean]
        # ScreeningGrid let only replies shaped like the spec (and an indicator) through
        replies = [parameters_to_ndarrays(r.parameters) for _, r in results]
        return [
            np.sum([np.asarray(a, np.float64) for a in layer], axis=0) for layer in zip(*replies, strict=True)
        ]

    def _nothing(self, server_round: int, reason: str) -> tuple[None, dict[str, Any]]:
        self.outcome.reason = reason
        log.warning("round %d makes no update: %s", server_round, reason)
        return None, {}


class WeightTotalSecAggPlus(SecAggPlusWorkflow):
    """Flower's SecAgg+ workflow (flwr 1.42), which also hands the strategy the total weight
    it unmasks (``NoisyMean.weight_total``) before the strategy aggregates. Flower divides the
    unmasked sum by that total and keeps it to itself; its unmask stage takes it from the sum
    with ``factor_extract``, which :func:`_record_weight_totals` wraps: the total reaches the
    strategy of the unmask stage running on the same thread, and nothing else changes."""

    def unmask_stage(self, grid: Any, context: Any, state: Any) -> bool:
        _record_weight_totals()
        strategy = context.strategy
        _weight_sink.record = lambda total: setattr(strategy, "weight_total", int(total))
        try:
            return super().unmask_stage(grid, context, state)
        finally:
            _weight_sink.record = None


_weight_sink = threading.local()  # per thread: the unmask stage in progress records here
_wrap_lock = threading.Lock()


def _record_weight_totals() -> None:
    """Wrap ``factor_extract`` in Flower's SecAgg+ workflow module, once: it returns what it
    did, and hands the extracted total weight to the unmask stage running on this thread (no
    other caller sees a difference)."""
    with _wrap_lock:
        if getattr(secaggplus_workflow.factor_extract, "records_weight_total", False):
            return

        def extract(parameters: list[np.ndarray]) -> tuple[int, list[np.ndarray]]:
            total, rest = factor_extract(parameters)
            record = getattr(_weight_sink, "record", None)
            if record is not None:
                record(total)
            return total, rest

        extract.records_weight_total = True  # type: ignore[attr-defined]
        secaggplus_workflow.factor_extract = extract


def _a2_claim(metrics: dict[str, Any]) -> Step | None:
    """The A.2 step a reply claims, None when malformed (a value that is not a finite number)."""
    try:
        noise, rate, steps = (float(metrics[k]) for k in A2_METRICS)
    except (KeyError, TypeError, ValueError):
        return None
    if not all(math.isfinite(v) for v in (noise, rate, steps)) or steps != int(steps):
        return None
    return (noise, rate, int(steps))


class PoissonSampling:
    """The client manager as FedAvg's ``configure_fit`` sees it: ``sample`` takes every available
    node independently with probability q (``fraction_fit``), by :func:`dp_fedavg.poisson_cohort`
    over the nodes in population order. That is the sampling the A.1 accountant's Poisson rate q
    assumes; FedAvg's own draw would take max(int(q N), min_fit_clients) nodes from Python's
    global generator, which any code may seed."""

    def __init__(
        self,
        manager: ClientManager,
        rate: float,
        rng: np.random.Generator,
        order: Callable[[list[str]], list[str]] | None = None,
    ) -> None:
        self._manager, self.rate, self.rng, self.order = manager, rate, rng, order
        self.available = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._manager, name)

    def sample(self, num_clients: int, min_num_clients: int | None = None, criterion: Any = None) -> list:
        self._manager.wait_for(min_num_clients or num_clients)
        available = self._manager.all()
        ids = self.order(list(available)) if self.order else sorted(available)
        self.available = len(ids)
        return [available[ids[i]] for i in poisson_cohort(len(ids), self.rate, self.rng)]


class ScreeningGrid:
    """The grid as the fit workflow sees it: every reply the server can read is checked against
    the adapter spec and dropped (the node counts as gone) when malformed; bytes are tallied.

    Under SecAgg+ it reads the masked vectors (integer arrays: count and shapes are checked);
    under plain FedAvg the contribution itself (dtype, shapes, finite values)."""

    def __init__(self, grid: Grid, spec: AdapterSpec) -> None:
        self._grid, self.spec = grid, spec
        self.bytes: list[int] = []
        self.rejected: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
        kept = []
        for reply in self._grid.send_and_receive(messages, timeout=timeout):
            problem = None if reply.has_error() else self.screen(reply)
            if problem:
                self.rejected.append(problem)
                log.warning("rejected an update from node %s: %s", reply.metadata.src_node_id, problem)
                continue
            kept.append(reply)
        return kept

    def screen(self, reply: Message) -> str | None:
        configs = reply.content.config_records.get(RECORD_KEY_CONFIGS)
        shapes = [*self.spec.shapes, (1,)]  # the adapter tensors and the A.1 indicator
        if configs is not None and Key.MASKED_PARAMETERS in configs:
            blobs = list(configs[Key.MASKED_PARAMETERS])
            self.bytes.append(sum(len(b) for b in blobs))
            masked = [bytes_to_ndarray(b) for b in blobs]
            expected = [(1,), *shapes]  # SecAgg+'s weight factor, the tensors, the indicator
            got = [a.shape for a in masked]
            if got != expected:
                at = next(
                    (i for i, (g, e) in enumerate(zip(got, expected, strict=False)) if g != e), len(got)
                )
                return (
                    f"masked vector does not fit the adapter: {len(got)} arrays, {len(expected)} "
                    f"expected, first mismatch at array {at}"
                )
            bad = [str(a.dtype) for a in masked if a.dtype.kind not in "iu"]
            return f"masked vector of dtype {bad[0]}, expected integers" if bad else None
        if FIT_PARAMS in reply.content.array_records:
            arrays = parameters_to_ndarrays(compat.arrayrecord_to_parameters(reply.content[FIT_PARAMS], True))
            self.bytes.append(sum(a.nbytes for a in arrays))
            if len(arrays) != len(shapes):
                return f"{len(arrays)} tensors, expected {len(shapes)}"
            return check_update(arrays[:-1], self.spec) or (
                None if np.isfinite(arrays[-1]).all() and arrays[-1].shape == (1,) else "bad A.1 indicator"
            )
        return None
