"""The server side of a federation: the round loop behind the Flower ServerApp.

Per round: check the privacy budget, run one fit round (SecAgg+ by default, so the server only
ever holds the masked vectors and their sum), screen every reply it can see, release nothing
unless at least ``min_participants`` real A.1 updates are in the sum, add Gaussian noise to the
sum of the contributions (user-level DP for A.1), check the round's actual privacy spend against
the budget, and only then release: adopt the new global adapter, account every mechanism that
ran, evaluate on server-side held-out data and checkpoint. A killed server resumes after the last
completed round; a stopped one (budget, overflow) stays stopped.

How the pieces compose: each node sends its *contribution*, the update (trained minus global
adapter) followed by the A.1 indicator (s = C/2 for a real A.1 update, 0 otherwise), clipped as
one vector to just under ``C`` (``mods.clip_mod``, ``wire.contribution_bound``) and masked
(``secaggplus_mod``). SecAgg+ reveals only the sum of the ``n`` nodes' contributions. The
indicator sum / s is the exact number of real A.1 updates in it, known only to the server: fewer
than ``min_participants`` and the round releases nothing and spends nothing. Otherwise
:class:`NoisyMean` releases DP-FedAvg exactly as accounted (:mod:`nimmer_train.privacy.dp_fedavg`):
nodes Poisson-sampled at rate q from a population of N, N(0, (z C)^2) added to every coordinate
of the sum (indicator included) from a generator seeded from the OS's entropy, the noisy sum
divided by the *expected* cohort q N, a fixed denominator: one Gaussian mechanism of sensitivity
C / (q N) whoever answered, accounted as one A.1 step at rate q (Opacus RDP). Dropouts cost
utility, never privacy. The server itself holds the exact sum (it unmasks it to count), so the
threshold keeps a round out of the outputs, not out of the server's sight. The new global adapter
is the old one plus the released mean; the noisy indicator sum / s is released as the round's
noised count of A.1 contributions. Exact counts never leave the server.

Durability: the budget of all T rounds is checked before round 1 (a federation that cannot end
within its budget never starts). A round's spend is written to the ledger (state.json,
``pending``) before its release is adopted; a server killed in between finds the pending round
on restart, keeps it accounted and never re-runs it.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.common import (
    FitRes,
    Parameters,
    bytes_to_ndarray,
    ndarrays_to_parameters,
    parameters_to_ndarrays,
)
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerConfig
from flwr.server.client_manager import ClientManager
from flwr.server.client_proxy import ClientProxy
from flwr.server.compat.app_utils import start_update_client_manager_thread
from flwr.server.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.serverapp.grid import Grid

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import (
    SECAGG_MAX_NODES,
    SECAGG_MODULUS_RANGE,
    SECAGG_QUANTIZATION_RANGE,
    FederatedConfig,
)
from nimmer_train.federation.wire import (
    A2_METRICS,
    QUANTUM,
    AdapterSpec,
    check_update,
    get_arrays,
    indicator_value,
    secagg_quantum,
    set_arrays,
    spec_of,
)
from nimmer_train.loras.train import heldout_loss
from nimmer_train.memory.consent import NEVER_SHARED
from nimmer_train.memory.entries import DATA_CATEGORIES
from nimmer_train.privacy.a2_pool import noised_counts
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, Step
from nimmer_train.privacy.dp_fedavg import Mechanism, entropy_rng, poisson_cohort, release_arrays
from nimmer_train.privacy.dp_sgd import accounted_rate, public_sample_rate

log = logging.getLogger(__name__)
FIT_PARAMS = "fitres.parameters"
STATE_FILE = "state.json"  # the server's round checkpoint, beside the arrays it names
Report = Callable[[dict[str, Any]], None]


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
    checked before use.

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
    ) -> None:
        mechanism = {  # what a device needs to compute the federation's epsilon (client.A1_MECHANISM)
            "a1-noise-multiplier": settings.noise_multiplier,
            "a1-sample-rate": settings.fraction_fit,
        }
        inner = FedAvg(
            fraction_fit=settings.fraction_fit,
            fraction_evaluate=0.0,
            min_fit_clients=settings.min_participants,
            min_available_clients=settings.min_participants,
            on_fit_config_fn=lambda server_round: {
                **fit_config,
                **mechanism,
                "a1-released-rounds": released(),
                "round": server_round,
            },
            accept_failures=True,
        )
        super().__init__(inner, settings.noise_multiplier, settings.clipping_norm, settings.min_participants)
        self.settings, self.spec = settings, spec
        self.mechanism = mechanism_of(settings)
        self.rng, self.order = rng, order
        self.outcome = RoundOutcome()

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, Any]]:
        sampling = PoissonSampling(client_manager, self.settings.fraction_fit, self.rng(), self.order)
        chosen = super().configure_fit(server_round, parameters, sampling)
        self.outcome = RoundOutcome(
            sampled=len(chosen), available=sampling.available, reason="" if chosen else "no node was sampled"
        )
        if self.settings.secure_aggregation and len(chosen) > SECAGG_MAX_NODES:
            self.outcome.reason = self.outcome.stop = (
                f"SecAgg+ overflow: {len(chosen)} nodes sampled, but SecAgg+'s masked sum overflows its "
                f"modulus 2^32 at 1024 nodes (quantisation range 2^22 each); at most {SECAGG_MAX_NODES} "
                "per round: lower federated.fraction_fit"
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
        *total, indicator_sum = self._sum(results)  # the sums over the n nodes, float64
        problem = check_update([a.astype(np.float32) for a in total], self.spec)
        indicator = float(indicator_sum.reshape(-1)[0])
        s = indicator_value(self.clipping_norm)
        a1 = indicator / s  # exact, to SecAgg+'s rounding: n nodes, each off by < 2 quanta
        if problem is None and (not np.isfinite(indicator) or abs(a1 - round(a1)) > 0.25 or a1 < -0.25):
            problem = "the A.1 indicators do not sum to a whole count"
        claims = [r.metrics for _, r in results if any(k in r.metrics for k in A2_METRICS)]
        a2 = planned_a2(self.settings)
        if problem is None and any(_a2_claim(m) != a2 for m in claims):
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

    def _sum(self, results: list[tuple[ClientProxy, FitRes]]) -> list[np.ndarray]:
        """The sum of the n contributions, float64. Under SecAgg+ every result carries the same
        unmasked mean (an exact integer sum, dequantised in float64): times n. FedAvg's average of
        plain contributions runs in float32, whose rounding lets one contribution move the sum by
        more than C (1.00001 C beside 600 others): they are summed in float64 here instead."""
        if self.settings.secure_aggregation:
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


def mechanism_of(settings: FederatedConfig) -> Mechanism:
    """The user-level (A.1) mechanism these settings run: N, q, z, C, T, delta."""
    return Mechanism(
        population=settings.nodes(),
        sample_rate=settings.fraction_fit,
        noise_multiplier=settings.noise_multiplier,
        clip=settings.clipping_norm,
        rounds=settings.rounds,
        delta=settings.delta,
    )


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


@dataclass
class ServerState:
    """Everything a restarted server needs, written atomically after each round."""

    round: int = 0
    stopped: str | None = None
    initial_loss: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    # the A.2 pool's noised counts, released once when the rounds end (None: not yet)
    pool_counts: dict[str, Any] | None = None
    pending: int | None = None  # a round accounted in the ledger whose release was not yet adopted

    @classmethod
    def load(cls, work: Path) -> ServerState:
        path = work / STATE_FILE
        if not path.exists():
            return cls()
        data = json.loads(path.read_text())
        data.pop("contributors", None)  # before issue 20 the server listed contributor ids; no more
        return cls(**data)

    def save(self, work: Path, arrays: list[np.ndarray]) -> None:
        """The round's arrays first, then the state that names them: a kill leaves the last
        complete round in place."""
        arrays_file = self._arrays_file(work)
        tmp = arrays_file.with_suffix(".tmp.npz")
        np.savez(tmp, *arrays)
        tmp.replace(arrays_file)
        write_json_atomic(work / STATE_FILE, asdict(self))
        for old in work.glob("global-r*.npz"):
            if old != arrays_file:
                old.unlink()

    def arrays(self, work: Path) -> list[np.ndarray] | None:
        path = self._arrays_file(work)
        if not path.exists():
            return None
        with np.load(path) as data:
            return [data[f"arr_{i}"] for i in range(len(data.files))]

    def _arrays_file(self, work: Path) -> Path:
        return work / f"global-r{self.round:04d}.npz"


@dataclass
class ServerSetup:
    """Where the server's inputs and state live (all on the server's side)."""

    model: Any  # the base with the register adapter, for evaluation and saving
    heldout: list[dict[str, list[int]]]  # server-side held-out examples, tokenised
    pad_id: int
    work: Path
    a2_pool: Path | None = None  # the A.2 intake, when the server knows where it is (for planning)


def make_setup(
    base_dir: Path, adapter_dir: Path, work: Path, settings: FederatedConfig, a2_pool: Path | None
) -> ServerSetup:
    """The server's evaluation model and its held-out set: synthetic examples drawn by the server
    itself from the player generator (public data, never a contributor's)."""
    from transformers import AutoTokenizer

    from nimmer_train.federation.client import example_text
    from nimmer_train.federation.local_training import encode_rows, load_trainable
    from nimmer_train.federation.population import heldout_seed
    from nimmer_train.memory.synthetic import heldout_examples

    model = load_trainable(base_dir, adapter_dir)[0].eval()
    texts = [
        example_text(e) for e in heldout_examples(settings.heldout_examples, seed=heldout_seed(settings.seed))
    ]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = encode_rows(tokenizer, texts, settings.max_length)
    return ServerSetup(model, rows, tokenizer.pad_token_id, work, a2_pool)


def fit_config(settings: FederatedConfig, spec: AdapterSpec) -> dict[str, Any]:
    """The per-round instructions every client receives (no ids, no data). ``seed`` drives only
    data order and initialisation on the nodes, never their DP noise or sampling masks."""
    keys = [
        "local_steps",
        "batch_size",
        "lr",
        "max_length",
        "max_examples",
        "local_dp",
        "dp_noise_multiplier",
        "dp_max_grad_norm",
        "grad_sample_mode",
        "seed",
        "delta",
        "a2_k",
    ]
    quantum = (
        secagg_quantum(settings.clipping_norm, SECAGG_QUANTIZATION_RANGE)
        if settings.secure_aggregation
        else 0.0
    )
    return {
        "spec-digest": spec.digest,
        QUANTUM: quantum,
        **{k.replace("_", "-"): getattr(settings, k) for k in keys},
    }


def planned_a2(settings: FederatedConfig) -> Step:
    """The A.2 node's accounting step, a function of the settings only (never of the pool's size,
    which the published A.2 epsilon would otherwise reveal): Poisson batches at the public rate
    batch_size / max_examples as Opacus accounts it (``dp_sgd.accounted_rate``), local_steps.
    The A.2 node takes and reports exactly this step; the server accepts no other."""
    rate = accounted_rate(public_sample_rate(settings.batch_size, settings.max_examples))
    return (settings.dp_noise_multiplier, rate, settings.local_steps)


def count_step(settings: FederatedConfig) -> Step:
    """The A.2 ledger's step for the noised release of the pool's counts (one Gaussian mechanism)."""
    return (settings.count_noise_multiplier, 1.0, 1)


def serve(
    grid: Grid,
    context: Context,
    settings: FederatedConfig,
    setup: ServerSetup,
    report: Report,
    rng: Callable[[], np.random.Generator] = entropy_rng,
    order: Callable[[list[str]], list[str]] | None = None,
) -> ServerState:
    """Run the remaining rounds, then release the A.2 pool's noised counts; returns the final
    state (also on disk). A federation that stopped (budget, overflow) is not resumed; one whose
    configuration cannot stay within its budget raises BudgetExceeded before round 1.
    ``rng`` and ``order``: see :class:`NoisyMean` (tests only; production uses the OS's entropy)."""
    setup.work.mkdir(parents=True, exist_ok=True)
    state = ServerState.load(setup.work)
    ledger = _ledger(state, settings)
    if state.stopped not in (None, "completed"):
        log.warning("the federation stopped earlier and is not resumed: %s", state.stopped)
        arrays = _start_arrays(state, setup, report)
    else:
        _settle_pending(state, ledger, settings, setup)
        require_budget(settings, ledger, state, setup.a2_pool is not None)
        arrays = _start_arrays(state, setup, report)
        state.stopped = None
        arrays = _rounds(grid, context, settings, setup, ledger, state, arrays, report, rng, order)
        state.stopped = state.stopped or "completed"
    _release_pool_counts(state, ledger, settings, setup)
    state.ledger = asdict(ledger)
    state.save(setup.work, arrays)
    set_arrays(setup.model, arrays)
    return state


def _rounds(
    grid: Grid,
    context: Context,
    settings: FederatedConfig,
    setup: ServerSetup,
    ledger: Ledger,
    state: ServerState,
    arrays: list[np.ndarray],
    report: Report,
    rng: Callable[[], np.random.Generator] = entropy_rng,
    order: Callable[[list[str]], list[str]] | None = None,
) -> list[np.ndarray]:
    """The rounds after ``state.round``; ``state.stopped`` says why they ended early, if they did."""
    spec = spec_of(setup.model)
    released = lambda: sum(steps for _, _, steps in ledger.a1)  # noqa: E731 - rounds released so far
    strategy = NoisyMean(settings, spec, fit_config(settings, spec), rng, order, released)
    legacy = LegacyContext(
        context=context,
        config=ServerConfig(num_rounds=settings.rounds, round_timeout=settings.round_timeout),
        strategy=strategy,
    )
    thread, stop, ready = start_update_client_manager_thread(grid, legacy.client_manager)
    ready.wait()
    loop = _RoundLoop(
        grid, settings, setup, spec, ledger, strategy, legacy, _fit_workflow(settings), _round_config(legacy)
    )
    try:
        for server_round in range(state.round + 1, settings.rounds + 1):
            a1_step: Step = (settings.noise_multiplier, settings.fraction_fit, 1)
            over_budget = _plan_budget(loop, a1_step, state)
            if over_budget:
                state.stopped = over_budget
                break
            arrays, record, stopping = _run_round(
                loop, server_round, a1_step, arrays, _reserve(loop, state), state
            )
            _checkpoint(state, loop, record, arrays, stopping)
            report(record)
            log.info("round %d: %s", server_round, _summary(record))
            if stopping:
                log.warning("the federation stops: %s", stopping)
                break
    finally:
        stop.set()
        thread.join()
    return arrays


@dataclass
class _RoundLoop:
    """What every round of one ``serve`` call works with."""

    grid: Grid
    settings: FederatedConfig
    setup: ServerSetup
    spec: AdapterSpec
    ledger: Ledger
    strategy: NoisyMean
    legacy: LegacyContext
    fit: Callable[[Any, LegacyContext], None]  # the fit workflow: SecAgg+ or plain FedAvg
    round_config: Any  # the ConfigRecord the workflow reads the current round from


def _ledger(state: ServerState, settings: FederatedConfig) -> Ledger:
    """The privacy ledger as the last completed round left it (empty on a fresh start)."""
    if state.ledger:
        return Ledger.from_dict(state.ledger, settings.delta, settings.epsilon_budget)
    return Ledger(settings.delta, settings.epsilon_budget)


def require_budget(settings: FederatedConfig, ledger: Ledger, state: ServerState, pool: bool) -> None:
    """BudgetExceeded, naming the epsilon it would spend, when the configured rounds cannot all
    be released within ``epsilon_budget``: the user-level ledger after every remaining round, and
    the record-level one with one A.2 run per remaining round (and the pool counts' release)."""
    if settings.epsilon_budget is None:
        return
    remaining = max(0, settings.rounds - state.round)
    mechanism_of(settings).require(settings.epsilon_budget)  # names N, q, z of a hopeless config
    a1: Step | None = (settings.noise_multiplier, settings.fraction_fit, remaining) if remaining else None
    z, rate, steps = planned_a2(settings)
    a2 = [(z, rate, steps * remaining)] if remaining else []
    reserve = [count_step(settings)] if pool and state.pool_counts is None else []
    ledger.plan(a1, [*a2, *reserve], what=f"the {remaining} remaining rounds of this federation")


def _settle_pending(
    state: ServerState, ledger: Ledger, settings: FederatedConfig, setup: ServerSetup
) -> None:
    """A round accounted before its release but killed before its arrays were adopted: its
    spend stays in the ledger, it is recorded as not released, and it is never run again."""
    if state.pending is None or state.pending <= state.round:
        state.pending = None
        return
    record = {
        "round": state.pending,
        "accepted": False,
        "reason": "accounted, then the server stopped before adopting the release: not re-run",
        **mechanism_of(settings).describe(),
    }
    log.warning("round %d: %s", state.pending, record["reason"])
    arrays = state.arrays(setup.work) or get_arrays(setup.model)  # the last adopted round's
    state.round, state.pending = record["round"], None
    state.records.append(record)
    state.ledger = asdict(ledger)
    state.save(setup.work, arrays)


def _start_arrays(state: ServerState, setup: ServerSetup, report: Report) -> list[np.ndarray]:
    """The global adapter after the last completed round, else the register adapter (whose
    held-out loss is then measured and reported as round 0)."""
    arrays = state.arrays(setup.work) or get_arrays(setup.model)
    if state.round:
        log.info("resuming the federation after round %d", state.round)
    if state.initial_loss is None:
        state.initial_loss = _evaluate(setup, arrays)
        report({"round": 0, "heldout_loss": state.initial_loss})
    return arrays


def _fit_workflow(settings: FederatedConfig) -> Callable[[Any, LegacyContext], None]:
    if not settings.secure_aggregation:
        return default_fit_workflow
    return SecAggPlusWorkflow(
        *settings.secagg(),
        max_weight=1.0,  # every contributor weighs 1: keeps SecAgg+'s quantisation at full precision
        # a contribution's norm is <= C, so is every coordinate: SecAgg+ never clips one, and its
        # rounding (wire.contribution_bound) scales with C
        clipping_range=settings.clipping_norm,
        quantization_range=SECAGG_QUANTIZATION_RANGE,
        modulus_range=SECAGG_MODULUS_RANGE,
        timeout=settings.round_timeout,
    )


def _round_config(legacy: LegacyContext) -> Any:
    from flwr.common import ConfigRecord

    round_cfg = ConfigRecord()
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = round_cfg
    return round_cfg


def _reserve(loop: _RoundLoop, state: ServerState) -> list[Step]:
    """Budget kept back for the pool's noised counts, released when the rounds end."""
    if loop.setup.a2_pool is None or state.pool_counts is not None:
        return []
    return [count_step(loop.settings)]


def _plan_budget(loop: _RoundLoop, a1_step: Step, state: ServerState) -> str | None:
    """Plan the next round's privacy spend (A.1 and one A.2 run, whether or not the pool will
    train: a plan that read the pool would make the stop depend on it; the pool counts' step kept
    in reserve); the reason to stop when it would exceed the budget, else None."""
    try:
        loop.ledger.plan(a1_step, [planned_a2(loop.settings), *_reserve(loop, state)])
    except BudgetExceeded as exc:
        log.warning("%s", exc)
        return f"budget: {exc}"
    return None


def _run_round(
    loop: _RoundLoop,
    server_round: int,
    a1_step: Step,
    arrays: list[np.ndarray],
    reserve: list[Step],
    state: ServerState | None = None,
) -> tuple[list[np.ndarray], dict[str, Any], str | None]:
    """One fit round from ``arrays``: the new global arrays (the same ones when the round
    releases nothing), the round's record, and a reason to stop the federation (or None).

    The round's actual steps (A.1, every A.2 node's, and ``reserve``) are checked against the
    budget before anything is released: over it, the round is discarded (no arrays adopted,
    nothing accounted) and the federation stops. Within it, the spend is accounted and written
    (``state.pending``) before the released mean is adopted."""
    settings = loop.settings
    started = time.monotonic()
    screen = _fit_round(loop, server_round, arrays)
    out = loop.strategy.outcome
    mechanism = mechanism_of(settings)
    record: dict[str, Any] = {
        "round": server_round,
        "sampled": out.sampled,
        "available": out.available,
        "participants": out.participants,
        "dropped": out.sampled - out.participants - len(screen.rejected),  # failed or timed out
        "rejected": screen.rejected,
        "bytes_per_client": screen.bytes,
        "update_bytes": loop.spec.nbytes,
        "accepted": False,
        "reason": out.reason,
        **mechanism.describe(),  # N, q, expected cohort, z, C, T, delta, noise std, accountant, sampling
    }
    stopping = out.stop
    if out.accepted and out.update is not None:
        try:
            loop.ledger.plan(a1_step, [*out.a2_steps, *reserve], what=f"releasing round {server_round}")
        except BudgetExceeded as exc:
            record["reason"] = f"discarded before release: {exc}"
            stopping = f"budget: {exc}"
            log.warning("round %d is discarded: %s", server_round, exc)
        else:
            epsilons = loop.ledger.record(a1_step, out.a2_steps)
            if state is not None:  # write-ahead: the spend is on disk before the release is adopted
                state.pending, state.ledger = server_round, asdict(loop.ledger)
                write_json_atomic(loop.setup.work / STATE_FILE, asdict(state))
            arrays = [g + u for g, u in zip(arrays, out.update, strict=True)]
            record.update(
                {
                    k: (None if settings.no_privacy else v)
                    for k, v in epsilons.items()
                    if k.startswith("epsilon")
                },
                accepted=True,
                a1_contributions_noised=out.a1_noised,
                heldout_loss=_evaluate(loop.setup, arrays),
            )
    if not record["accepted"]:
        loop.ledger.rounds.append({"round": server_round, "delta": settings.delta, "released": False})
    record["seconds"] = time.monotonic() - started
    return arrays, record, stopping


def _release_pool_counts(
    state: ServerState, ledger: Ledger, settings: FederatedConfig, setup: ServerSetup
) -> None:
    """Release the A.2 pool's counts once, noised and accounted (its step was kept in reserve by
    every round's budget check); not at all when there is no pool or the budget forbids it."""
    if state.pool_counts is not None or setup.a2_pool is None:
        return
    step = count_step(settings)
    try:
        ledger.plan(None, [step], what="releasing the A.2 pool's noised counts")
    except BudgetExceeded as exc:
        state.pool_counts = {"released": False, "reason": f"budget: {exc}"}
        return
    eligible = [c for c in DATA_CATEGORIES if c not in NEVER_SHARED]
    rng = np.random.default_rng()  # seeded from the OS's entropy
    counts = noised_counts(setup.a2_pool, settings.a2_k, eligible, settings.count_noise_multiplier, rng)
    ledger.record_release("a2_pool_counts", step)
    state.pool_counts = {"released": True, **counts}


def _fit_round(loop: _RoundLoop, server_round: int, arrays: list[np.ndarray]) -> ScreeningGrid:
    """Send ``arrays`` out through the screening grid for one fit round; the strategy's
    ``outcome`` then holds what it saw, the returned grid what it rejected and the bytes."""
    loop.legacy.state.array_records[MAIN_PARAMS_RECORD] = compat.parameters_to_arrayrecord(
        ndarrays_to_parameters(arrays), True
    )
    loop.round_config[WorkflowKey.CURRENT_ROUND] = server_round
    screen = ScreeningGrid(loop.grid, loop.spec)
    loop.fit(screen, loop.legacy)
    return screen


def _checkpoint(
    state: ServerState,
    loop: _RoundLoop,
    record: dict[str, Any],
    arrays: list[np.ndarray],
    stopping: str | None,
) -> None:
    """The completed round into the state (record, ledger, why it stops), saved with its arrays."""
    state.stopped = stopping
    state.round = record["round"]
    state.pending = None
    state.records.append(record)
    state.ledger = asdict(loop.ledger)
    state.save(loop.setup.work, arrays)


def _evaluate(setup: ServerSetup, arrays: list[np.ndarray]) -> float:
    set_arrays(setup.model, arrays)
    return heldout_loss(setup.model, setup.heldout, setup.pad_id)


def _summary(record: dict[str, Any]) -> str:
    keys = (
        "participants",
        "dropped",
        "accepted",
        "heldout_loss",
        "epsilon_a1_user_level",
        "epsilon_a2_record_level",
    )
    return ", ".join(
        f"{k}={record[k]:.4g}" if isinstance(record.get(k), float) else f"{k}={record.get(k)}" for k in keys
    )
