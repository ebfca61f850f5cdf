"""The server side of a federation: the round loop behind the Flower ServerApp. What one round
samples, accepts and releases is :mod:`~nimmer_train.federation.strategy`'s; each mechanism's
step and the budget checks are :mod:`~nimmer_train.federation.budget`'s; the write-ahead
checkpoint is :mod:`~nimmer_train.federation.checkpoint`'s (shared with the sweep simulator).

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
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Context, Message
from flwr.app.message_type import MessageType
from flwr.common import ConfigRecord, EvaluateIns, ndarrays_to_parameters
from flwr.compat.common import recorddict_compat as compat
from flwr.server import LegacyContext, ServerConfig
from flwr.server.compat.app_utils import start_update_client_manager_thread
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.default_workflows import default_fit_workflow
from flwr.serverapp.grid import Grid
from transformers import AutoTokenizer

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import SECAGG_MODULUS_RANGE, SECAGG_QUANTIZATION_RANGE, FederatedConfig
from nimmer_train.federation.budget import (
    a1_step,
    a2_claim_key,
    mechanism_of,
    plan_round,
    release_pool_counts,
    require_budget,
    reserve,
)
from nimmer_train.federation.checkpoint import STATE_FILE, ServerState, ledger_of, write_ahead
from nimmer_train.federation.client import (
    FEDERATION_ID,
    NOT_RELEASED,
    OUTCOME,
    OUTCOME_EPSILON,
    ROUNDS_DONE,
    example_text,
)
from nimmer_train.federation.local_training import encode_rows, load_trainable
from nimmer_train.federation.population import heldout_seed
from nimmer_train.federation.results import epsilons, public_record
from nimmer_train.federation.strategy import (
    NoisyMean,
    RoundOutcome,
    ScreeningGrid,
    WeightTotalSecAggPlus,
    fit_config,
)
from nimmer_train.federation.wire import AdapterSpec, get_arrays, set_arrays, spec_of
from nimmer_train.loras.train import heldout_loss
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.accounting import BudgetExceeded, Ledger, Step
from nimmer_train.privacy.dp_fedavg import entropy_rng

log = logging.getLogger(__name__)
Report = Callable[[dict[str, Any]], None]
FEDERATION_FILE = "federation.json"  # the federation's id, made with its ledger in the work-dir
NODE_WAIT_NOTE_S = 10.0  # while too few nodes are online, a line this often
NODE_POLL_S = 1.0  # how often the server counts the nodes online while it waits
OUTCOME_TIMEOUT_S = 60.0  # how long the server waits for the nodes to take its outcome message


def federation_id(work: Path) -> str:
    """The federation's id: random, made once with its privacy ledger (the work-dir's state) and
    kept beside it, so a resumed server keeps it and a fresh work-dir (a new ledger) gets a new
    one. Devices key their spend by it (``client.FEDERATION_ID``): neither the SuperLink's address,
    the operator's CA nor the released version tells two federations apart, a ledger does."""
    path = work / FEDERATION_FILE
    if path.exists():
        return str(json.loads(path.read_text())["federation_id"])
    work.mkdir(parents=True, exist_ok=True)
    ident = uuid.uuid4().hex
    write_json_atomic(path, {"federation_id": ident})
    return ident


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
    model = load_trainable(base_dir, adapter_dir)[0].eval()
    texts = [
        example_text(e) for e in heldout_examples(settings.heldout_examples, seed=heldout_seed(settings.seed))
    ]
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    rows = encode_rows(tokenizer, texts, settings.local.max_length)
    return ServerSetup(model, rows, tokenizer.pad_token_id, work, a2_pool)


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
    asking = AskingGrid(grid)  # which nodes the rounds ask: they are told the outcome at the end
    state = ServerState.load(setup.work)
    ledger = ledger_of(state.ledger, settings)
    if state.stopped not in (None, "completed"):
        log.warning("the federation stopped earlier and is not resumed: %s", state.stopped)
        arrays = _start_arrays(state, setup, report)
    else:
        _settle_pending(state, ledger, settings, setup)
        require_budget(settings, ledger, state, setup.a2_pool is not None)
        arrays = _start_arrays(state, setup, report)
        state.stopped = None
        arrays = _rounds(asking, context, settings, setup, ledger, state, arrays, report, rng, order)
        state.stopped = state.stopped or "completed"
    release_pool_counts(state, ledger, settings, setup.a2_pool)
    state.ledger = asdict(ledger)
    state.save(setup.work, arrays)
    set_arrays(setup.model, arrays)
    tell_outcome(grid, settings, setup.work, state, asking.asked)
    return state


def outcome_config(work: Path, state: ServerState) -> dict[str, Any]:
    """What a device may know of the federation's rounds so far: its id, the last round done
    and the rounds done but not released (public: rounds.json says as much)."""
    not_released = [int(r["round"]) for r in state.records if not r.get("accepted")]
    return {
        FEDERATION_ID: federation_id(work),
        ROUNDS_DONE: state.round,
        NOT_RELEASED: json.dumps(not_released),
    }


class AskingGrid:
    """The grid as the rounds use it, noting which nodes they sent a message to (``asked``);
    everything else is the grid's."""

    def __init__(self, grid: Grid) -> None:
        self._grid, self.asked = grid, set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        messages = list(messages)
        self.asked.update(m.metadata.dst_node_id for m in messages)
        return self._grid.send_and_receive(messages, timeout=timeout)


def tell_outcome(
    grid: Grid, settings: FederatedConfig, work: Path, state: ServerState, asked: set[int]
) -> None:
    """The federation has ended: tell every node the rounds asked that is still online which
    rounds were released and the final user-level epsilon (an evaluate message, answered empty:
    ``Contributor.evaluate``), so a device's log stops saying "if this round is released". Only
    those: a simulation builds a node's data only when it is asked. A node that does not answer
    in time learns nothing more; nothing depends on it."""
    if not asked:  # no round ran here (a stopped federation restarted): nobody to tell
        return
    eps = epsilons(settings, state)["a1_user_level"]
    config = {
        **outcome_config(work, state),
        OUTCOME: 1,
        OUTCOME_EPSILON: "" if eps is None else float(eps),
        "delta": settings.delta,
    }
    ins = EvaluateIns(ndarrays_to_parameters([]), config)
    messages = [
        Message(
            compat.evaluateins_to_recorddict(ins, True), dst_node_id=nid, message_type=MessageType.EVALUATE
        )
        for nid in sorted(set(grid.get_node_ids()) & asked)
    ]
    if not messages:
        return
    try:
        replies = grid.send_and_receive(messages, timeout=OUTCOME_TIMEOUT_S)
    except Exception as exc:  # noqa: BLE001 - the federation is over; its outcome is on disk
        log.warning("could not tell the nodes the federation's outcome: %s", exc)
        return
    log.info(
        "told %d of %d node(s) which rounds were released",
        sum(not r.has_error() for r in replies),
        len(messages),
    )


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
    key = a2_claim_key(setup.a2_pool)  # only the pool's A.2 node can claim an A.2 step
    config = {**fit_config(settings, spec), **outcome_config(setup.work, state)}  # kept up to date below
    strategy = NoisyMean(settings, spec, config, rng, order, released, key)
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
            held = reserve(settings, state, setup.a2_pool)
            over_budget = plan_round(settings, ledger, held)
            if over_budget:
                state.stopped = over_budget
                break
            config.update(outcome_config(setup.work, state))  # what became of the rounds before
            await_nodes(legacy.client_manager, settings.min_participants, server_round)
            arrays, record, stopping = _run_round(loop, server_round, a1_step(settings), arrays, held, state)
            _checkpoint(state, loop, record, arrays, stopping)  # the exact record: server-side only
            _announce(record, settings, report)
            if stopping:
                log.warning("the federation stops: %s", stopping)
                break
    finally:
        stop.set()
        thread.join()
    return arrays


def await_nodes(
    manager: Any,
    needed: int,
    server_round: int,
    note_every: float | None = None,
    poll: float | None = None,
) -> int:
    """Wait until ``needed`` nodes are online (Flower samples none before: ``min-participants``
    SuperNodes, the A.2 node included), saying so: a line when the wait starts, one every
    ``note_every`` seconds (:data:`NODE_WAIT_NOTE_S`) and one when the round goes ahead.
    Returns the nodes online."""
    note_every = NODE_WAIT_NOTE_S if note_every is None else note_every
    poll = NODE_POLL_S if poll is None else poll
    online = manager.num_available()
    if online >= needed:
        return online
    started = last = time.monotonic()
    line = "round %d: waiting for %d nodes, %d online (%.0f s; min-participants=%d SuperNodes must be "
    line += "connected, the A.2 node included, before a round samples any)"
    log.info(line, server_round, needed, online, 0.0, needed)
    while online < needed:
        time.sleep(poll)
        online = manager.num_available()
        if online < needed and time.monotonic() - last >= note_every:
            last = time.monotonic()
            log.info(line, server_round, needed, online, last - started, needed)
    log.info(
        "round %d: %d nodes online after %.0f s; the round starts",
        server_round,
        online,
        time.monotonic() - started,
    )
    return online


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
    if not settings.secagg.enabled:
        return default_fit_workflow
    return WeightTotalSecAggPlus(  # NoisyMean refuses a total weight other than 1 per reply
        *settings.secagg.flower_args(),
        max_weight=1.0,  # every contributor weighs 1: keeps SecAgg+'s quantisation at full precision
        # a contribution's norm is <= C, so is every coordinate: SecAgg+ never clips one, and its
        # rounding (wire.contribution_bound) scales with C
        clipping_range=settings.user_dp.clipping_norm,
        quantization_range=SECAGG_QUANTIZATION_RANGE,
        modulus_range=SECAGG_MODULUS_RANGE,
        timeout=settings.round_timeout,
    )


def _round_config(legacy: LegacyContext) -> Any:
    round_cfg = ConfigRecord()
    legacy.state.config_records[MAIN_CONFIGS_RECORD] = round_cfg
    return round_cfg


def _run_round(
    loop: _RoundLoop,
    server_round: int,
    a1: Step,
    arrays: list[np.ndarray],
    held: list[Step],
    state: ServerState | None = None,
) -> tuple[list[np.ndarray], dict[str, Any], str | None]:
    """One fit round from ``arrays``: the new global arrays (the same ones when the round
    releases nothing), the round's record, and a reason to stop the federation (or None).

    The strategy aggregates (:meth:`NoisyMean.aggregate_fit`); a release it made is adopted
    only by :func:`_release`, after its spend is checked and written ahead."""
    started = time.monotonic()
    screen = _fit_round(loop, server_round, arrays)
    out = loop.strategy.outcome
    record = _record(loop, server_round, out, screen)
    stopping = out.stop
    if out.accepted and out.update is not None:
        arrays, stopping = _release(loop, server_round, a1, out, arrays, held, state, record)
    if not record["accepted"]:
        loop.ledger.rounds.append({"round": server_round, "delta": loop.settings.delta, "released": False})
    record["seconds"] = time.monotonic() - started
    return arrays, record, stopping


def _record(loop: _RoundLoop, server_round: int, out: RoundOutcome, screen: ScreeningGrid) -> dict[str, Any]:
    """The round's record as the strategy left it: who was sampled, answered, dropped or was
    rejected, the bytes, and the mechanism (N, q, expected cohort, z, C, T, delta, noise std,
    accountant, sampling); released figures are added by :func:`_release`."""
    return {
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
        **mechanism_of(loop.settings).describe(),
    }


def _release(
    loop: _RoundLoop,
    server_round: int,
    a1: Step,
    out: RoundOutcome,
    arrays: list[np.ndarray],
    held: list[Step],
    state: ServerState | None,
    record: dict[str, Any],
) -> tuple[list[np.ndarray], str | None]:
    """Adopt the strategy's released update: the round's actual steps (A.1, every A.2 node's,
    and ``held``) are checked against the budget first; over it, the round is discarded (no
    arrays adopted, nothing accounted) and the federation stops. Within it, the spend is
    accounted and written ahead (``state.pending``), then the update is added to ``arrays``."""
    assert out.update is not None
    try:
        loop.ledger.plan(a1, [*out.a2_steps, *held], what=f"releasing round {server_round}")
    except BudgetExceeded as exc:
        record["reason"] = f"discarded before release: {exc}"
        log.warning("round %d is discarded: %s", server_round, exc)
        return arrays, f"budget: {exc}"
    epsilons = loop.ledger.record(a1, out.a2_steps)
    if state is not None:  # write-ahead: the spend is on disk before the release is adopted
        write_ahead(loop.setup.work, STATE_FILE, state, server_round, loop.ledger)
    arrays = [g + u for g, u in zip(arrays, out.update, strict=True)]
    record.update(
        {
            k: (None if loop.settings.no_privacy else v)
            for k, v in epsilons.items()
            if k.startswith("epsilon")
        },
        accepted=True,
        a1_contributions_noised=out.a1_noised,
        heldout_loss=_evaluate(loop.setup, arrays),
    )
    return arrays, out.stop


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


def _announce(record: dict[str, Any], settings: FederatedConfig, report: Report) -> None:
    """The round's public record to ``report`` (MLflow) and one log line: noised figures and
    epsilons only, never the exact node counts the checkpoint keeps (issue 43)."""
    public = public_record(record, settings)
    report(public)
    log.info("round %d: %s", record["round"], _summary(public))


def _summary(record: dict[str, Any]) -> str:
    keys = (
        "accepted",
        "a1_contributions_noised",
        "heldout_loss",
        "epsilon_a1_user_level",
        "epsilon_a2_record_level",
    )
    return ", ".join(
        f"{k}={record[k]:.4g}" if isinstance(record.get(k), float) else f"{k}={record.get(k)}" for k in keys
    )
