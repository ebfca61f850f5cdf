"""The server side of a federation: the round loop behind the Flower ServerApp.

Per round: check the privacy budget, run one fit round (SecAgg+ by default, so the server only
ever holds the masked vectors and their sum), screen every reply it can see, add Gaussian noise
to the mean of the clipped updates (user-level DP for A.1), account both mechanisms, evaluate
the new global adapter on server-side held-out data, and checkpoint. A killed server resumes
after the last completed round.

How the pieces compose: each client clips its update to ``C`` (``mods.clip_mod``) and masks
it (``secaggplus_mod``); SecAgg+ reveals only the sum, which is divided by the number ``n`` of
surviving contributors; :class:`NoisyMean` then adds N(0, (z C / n)^2) to every coordinate, so
the release is the Gaussian mechanism with noise multiplier ``z`` on a sum of sensitivity ``C``
(one contributor), whatever ``n`` turned out to be.
"""

from __future__ import annotations

import json
import logging
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
from flwr.supercore.differential_privacy import add_gaussian_noise_to_params

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.wire import (
    EXAMPLES_SCALE,
    AdapterSpec,
    check_update,
    get_arrays,
    set_arrays,
    spec_of,
)
from nimmer_train.loras.train import heldout_loss
from nimmer_train.privacy.a2_pool import pool_summary
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, Step

log = logging.getLogger(__name__)
FIT_PARAMS = "fitres.parameters"
STATE_FILE = "state.json"  # the server's round checkpoint, beside the arrays it names
Report = Callable[[dict[str, Any]], None]


@dataclass
class RoundOutcome:
    """What the strategy saw of one round (never an individual update)."""

    sampled: int = 0
    participants: int = 0
    accepted: bool = False
    reason: str = ""
    examples: int = 0  # sum over contributors, learnt only as part of the aggregate
    a2: Step | None = None
    a2_examples: int = 0
    contributors: list[str] = field(default_factory=list)
    arrays: list[np.ndarray] | None = None


class NoisyMean(DifferentialPrivacyClientSideFixedClipping):
    """Flower's client-side-clipping DP wrapper around FedAvg, made robust: failures and dropouts
    do not void the round while ``min_participants`` remain, the noise is calibrated to the
    contributors that actually made it into the sum, and the aggregate is checked before use."""

    def __init__(self, settings: FederatedConfig, spec: AdapterSpec, fit_config: dict[str, Any]) -> None:
        inner = FedAvg(
            fraction_fit=settings.fraction_fit,
            fraction_evaluate=0.0,
            min_fit_clients=settings.min_participants,
            min_available_clients=settings.min_participants,
            on_fit_config_fn=lambda server_round: {**fit_config, "round": server_round},
            accept_failures=True,
        )
        super().__init__(inner, settings.noise_multiplier, settings.clipping_norm, settings.min_participants)
        self.settings, self.spec = settings, spec
        self.outcome = RoundOutcome()

    def configure_fit(
        self, server_round: int, parameters: Parameters, client_manager: ClientManager
    ) -> list[tuple[ClientProxy, Any]]:
        chosen = super().configure_fit(server_round, parameters, client_manager)
        self.outcome = RoundOutcome(sampled=len(chosen))
        return chosen

    def aggregate_fit(
        self,
        server_round: int,
        results: list[tuple[ClientProxy, FitRes]],
        failures: list[Any],
    ) -> tuple[Parameters | None, dict[str, Any]]:
        out = self.outcome
        out.participants = len(results)
        out.contributors = sorted(
            {str(r.metrics["contributor"]) for _, r in results if "contributor" in r.metrics}
        )
        if len(results) < self.settings.min_participants:
            out.reason = (
                f"{len(results)} contributors < federated.min_participants={self.settings.min_participants}"
            )
            log.warning("round %d makes no update: %s", server_round, out.reason)
            return None, {}
        mean, _ = self.strategy.aggregate_fit(server_round, results, [])
        *update, count = parameters_to_ndarrays(mean)
        update = [np.asarray(a, dtype=np.float32) for a in update]
        problem = check_update(update, self.spec) or (
            None if np.isfinite(count).all() else "count not finite"
        )
        if problem:
            out.reason = f"aggregate rejected: {problem}"
            log.warning("round %d makes no update: %s", server_round, out.reason)
            return None, {}
        noisy = add_gaussian_noise_to_params(
            ndarrays_to_parameters(update), self.noise_multiplier, self.clipping_norm, len(results)
        )
        out.arrays = [np.asarray(a, dtype=np.float32) for a in parameters_to_ndarrays(noisy)]
        out.examples = int(round(float(count[0]) * EXAMPLES_SCALE * len(results)))
        for _, res in results:
            if "a2-steps" in res.metrics and int(res.metrics["a2-steps"]) > 0:
                m = res.metrics
                out.a2 = (float(m["a2-noise"]), float(m["a2-sample-rate"]), int(m["a2-steps"]))
                out.a2_examples = int(m["a2-examples"])
        out.accepted = True
        return ndarrays_to_parameters(out.arrays), {}


class ScreeningGrid:
    """The grid as the fit workflow sees it: every reply the server can read is checked against
    the adapter spec and dropped (the node counts as gone) when malformed; bytes are tallied.

    Under SecAgg+ it reads the masked vectors (integer arrays: count and shapes are checked);
    under plain FedAvg the update itself (dtype, shapes, finite values)."""

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
        shapes = [*self.spec.shapes, (1,)]  # the adapter tensors and the example count
        if configs is not None and Key.MASKED_PARAMETERS in configs:
            blobs = list(configs[Key.MASKED_PARAMETERS])
            self.bytes.append(sum(len(b) for b in blobs))
            masked = [bytes_to_ndarray(b) for b in blobs]
            expected = [(1,), *shapes]  # SecAgg+'s weight factor, the tensors, the count
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
                None if np.isfinite(arrays[-1]).all() and arrays[-1].shape == (1,) else "bad example count"
            )
        return None


@dataclass
class ServerState:
    """Everything a restarted server needs, written atomically after each round."""

    round: int = 0
    stopped: str | None = None
    initial_loss: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    contributors: list[str] = field(default_factory=list)  # pseudonymous ids, for the count
    ledger: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, work: Path) -> ServerState:
        path = work / STATE_FILE
        return cls(**json.loads(path.read_text())) if path.exists() else cls()

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
    from nimmer_train.memory.synthetic import heldout_examples

    model = load_trainable(base_dir, adapter_dir)[0].eval()
    texts = [
        example_text(e) for e in heldout_examples(settings.heldout_examples, seed=10_000 + settings.seed)
    ]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = encode_rows(tokenizer, texts, settings.max_length)
    return ServerSetup(model, rows, tokenizer.pad_token_id, work, a2_pool)


def fit_config(settings: FederatedConfig, spec: AdapterSpec) -> dict[str, Any]:
    """The per-round instructions every client receives (no ids, no data)."""
    keys = [
        "local_steps",
        "batch_size",
        "lr",
        "max_length",
        "max_examples",
        "dp_noise_multiplier",
        "dp_max_grad_norm",
        "grad_sample_mode",
        "seed",
        "delta",
        "a2_k",
    ]
    return {"spec-digest": spec.digest, **{k.replace("_", "-"): getattr(settings, k) for k in keys}}


def planned_a2(settings: FederatedConfig, pool_examples: int | None) -> Step | None:
    """The A.2 accounting step a round will take: Poisson batches at 1/ceil(n/b), local_steps."""
    if pool_examples == 0:
        return None
    if pool_examples is None:
        return (settings.dp_noise_multiplier, 1.0, settings.local_steps)  # unknown pool: assume the worst
    n = min(pool_examples, settings.max_examples)
    batches = -(-n // min(settings.batch_size, n))
    return (settings.dp_noise_multiplier, 1 / batches, settings.local_steps)


def serve(
    grid: Grid, context: Context, settings: FederatedConfig, setup: ServerSetup, report: Report
) -> ServerState:
    """Run the remaining rounds; returns the final state (also on disk)."""
    setup.work.mkdir(parents=True, exist_ok=True)
    state = ServerState.load(setup.work)
    ledger = _ledger(state, settings)
    spec = spec_of(setup.model)
    arrays = _start_arrays(state, setup, report)
    strategy = NoisyMean(settings, spec, fit_config(settings, spec))
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
            over_budget = _plan_budget(loop, a1_step)
            if over_budget:
                state.stopped = over_budget
                break
            arrays, record = _run_round(loop, server_round, a1_step, arrays)
            _checkpoint(state, loop, record, arrays)
            report(record)
            log.info("round %d: %s", server_round, _summary(record))
    finally:
        stop.set()
        thread.join()
    if state.stopped is None:
        state.stopped = "completed"
    state.save(setup.work, arrays)
    set_arrays(setup.model, arrays)
    return state


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
        timeout=settings.round_timeout,
    )


def _round_config(legacy: LegacyContext) -> Any:
    from flwr.common import ConfigRecord

    round_cfg = ConfigRecord()
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = round_cfg
    return round_cfg


def _plan_budget(loop: _RoundLoop, a1_step: Step) -> str | None:
    """Plan the next round's privacy spend (A.1 and, when the pool has data, A.2); the reason to
    stop when it would exceed the budget, else None."""
    settings, setup = loop.settings, loop.setup
    pool = pool_summary(setup.a2_pool, settings.a2_k)["examples"] if setup.a2_pool else None
    try:
        loop.ledger.plan(a1_step, planned_a2(settings, pool))
    except BudgetExceeded as exc:
        log.warning("%s", exc)
        return f"budget: {exc}"
    return None


def _run_round(
    loop: _RoundLoop, server_round: int, a1_step: Step, arrays: list[np.ndarray]
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """One fit round from ``arrays``: the new global arrays (the same ones when the round makes
    no update) and the round's record; the release, if any, is accounted in the ledger."""
    settings = loop.settings
    started = time.monotonic()
    screen = _fit_round(loop, server_round, arrays)
    out = loop.strategy.outcome
    record: dict[str, Any] = {
        "round": server_round,
        "sampled": out.sampled,
        "participants": out.participants,
        "dropped": out.sampled - out.participants - len(screen.rejected),  # failed or timed out
        "rejected": screen.rejected,
        "bytes_per_client": screen.bytes,
        "update_bytes": loop.spec.nbytes,
        "accepted": out.accepted,
        "reason": out.reason,
    }
    if out.accepted and out.arrays is not None:
        arrays = out.arrays
        epsilons = loop.ledger.record(a1_step, out.a2)
        record.update(
            {k: v for k, v in epsilons.items() if k.startswith("epsilon")},
            noise_std=settings.noise_multiplier * settings.clipping_norm / out.participants,
            examples_a1=max(out.examples - out.a2_examples, 0),
            examples_a2=out.a2_examples,
            heldout_loss=_evaluate(loop.setup, arrays),
        )
    else:
        loop.ledger.rounds.append({"round": server_round, "delta": settings.delta, "released": False})
    record["seconds"] = time.monotonic() - started
    return arrays, record


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
    state: ServerState, loop: _RoundLoop, record: dict[str, Any], arrays: list[np.ndarray]
) -> None:
    """The completed round into the state (contributors, record, ledger), saved with its arrays."""
    state.contributors = sorted(set(state.contributors) | set(loop.strategy.outcome.contributors))
    state.round = record["round"]
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
