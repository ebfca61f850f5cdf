"""The federation's mechanism in one process, for privacy-utility sweeps.

Exactly the Flower round loop's DP-FedAvg (:mod:`nimmer_train.privacy.dp_fedavg`), without
Flower, Ray, SecAgg+ or a model load per contributor: each round draws the cohort with
:func:`poisson_cohort` over the N nodes (the population's contributors, then the A.2 node), trains
every sampled contributor with the client's own local update (``local_training.sgd_locally`` on one
loaded model, from the same device built by the same :class:`Population`), turns it into the
client's contribution (``mods.contribution``: update and A.1 indicator, clipped under C), sums in
float64, applies the same release threshold and releases with :func:`release_arrays` (noise z C,
fixed denominator q N). The generator is drawn from in the same order as the Flower path (cohort,
then noise), so on the same seeds with SecAgg+ off both select the same cohorts and release the
same aggregate (a test holds them to 1e-5): the simulator's figures are figures of the pipeline.

Scope: A.1 contributors with plain local SGD (``federated.local_dp.on_devices=false``; local DP-SGD draws
its noise from the OS's entropy and could not be compared) and no A.2 uploads (the A.2 node then
contributes nothing, as in the Flower path with an empty pool).

Durable: after each round the arrays, the ledger and the records are written (the spend first,
as in the round loop); a rerun resumes after the last round and never re-runs a released one.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.errors import ConfigError
from nimmer_train.federation.budget import mechanism_of
from nimmer_train.federation.checkpoint import ledger_of, load_arrays, save_round, write_ahead
from nimmer_train.federation.client import device_examples
from nimmer_train.federation.local_training import LocalTrainingConfig, sgd_locally
from nimmer_train.federation.mods import contribution
from nimmer_train.federation.population import Population, heldout_seed
from nimmer_train.federation.wire import get_arrays, indicator_value, set_arrays
from nimmer_train.privacy.dp_fedavg import entropy_rng, poisson_cohort, release_arrays

STATE = "simulation.json"
Progress = Callable[[dict[str, Any]], None]


@dataclass
class SimulationState:
    """A simulated federation after ``round`` rounds (beside ``global-rNNNN.npz``)."""

    round: int = 0
    pending: int | None = None  # accounted, release not yet adopted (a kill in between)
    initial_loss: float | None = None
    records: list[dict[str, Any]] = field(default_factory=list)
    ledger: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0


@dataclass
class Simulator:
    """One loaded model, the population, the server's held-out rows; :meth:`run` a federation."""

    model: Any  # the base with the register adapter (PEFT), trainable
    tokenizer: Any
    population: Population
    heldout: list[dict[str, list[int]]]
    pad_id: int
    start: list[np.ndarray]  # the adapter every federation starts from (the model's at load)

    @classmethod
    def load(
        cls, base_dir: Path, adapter_dir: Path, population: Population, settings: FederatedConfig
    ) -> Simulator:
        """The model as a client loads it and the held-out set as the server draws it."""
        from nimmer_train.federation.client import example_text
        from nimmer_train.federation.local_training import encode_rows, load_trainable
        from nimmer_train.memory.synthetic import heldout_examples

        model, tokenizer = load_trainable(base_dir, adapter_dir)
        texts = [
            example_text(e)
            for e in heldout_examples(settings.heldout_examples, seed=heldout_seed(settings.seed))
        ]
        return cls(
            model,
            tokenizer,
            population,
            encode_rows(tokenizer, texts, settings.local.max_length),
            tokenizer.pad_token_id,
            get_arrays(model),
        )

    def contribution(
        self, i: int, arrays: list[np.ndarray], settings: FederatedConfig, server_round: int
    ) -> list[np.ndarray]:
        """Node ``i``'s clipped contribution (update and A.1 indicator, float32), as its client
        would send it with SecAgg+ off; the A.2 node (index N - 1) and a device without shareable
        examples send a zero update with indicator 0."""
        texts = [] if i == self.population.size else device_examples(self.population.device(i))[0]
        if not texts:
            zeros = [np.zeros(a.shape, np.float64) for a in arrays]
            return contribution(zeros, False, settings.user_dp.clipping_norm, 0.0)
        trained, _ = sgd_locally(
            self.model, self.tokenizer, arrays, texts, local_settings(settings, server_round)
        )
        update = [np.subtract(a, b, dtype=np.float64) for a, b in zip(trained, arrays, strict=True)]
        return contribution(update, True, settings.user_dp.clipping_norm, 0.0)

    def evaluate(self, arrays: list[np.ndarray]) -> float:
        from nimmer_train.loras.train import heldout_loss

        set_arrays(self.model, arrays)
        self.model.eval()
        loss = heldout_loss(self.model, self.heldout, self.pad_id)
        self.model.train()
        return loss

    def run(
        self,
        settings: FederatedConfig,
        work: Path,
        rng: np.random.Generator | None = None,
        progress: Progress | None = None,
        evaluate_every: int = 0,
    ) -> SimulationState:
        """The federation ``settings`` describe, round by round into ``work`` (resumed if a run
        was there). ``rng``: a test's or a sweep's seeded generator; the OS's entropy by default.
        ``evaluate_every``: held-out loss every k rounds (0: only after the last)."""
        check_simulable(settings, self.population)
        mechanism = mechanism_of(settings)
        mechanism.require(settings.epsilon_budget)  # before round 1: the whole run fits the budget
        work.mkdir(parents=True, exist_ok=True)
        state = _load(work)
        ledger = ledger_of(state.ledger, settings, where=str(work / STATE))
        saved = load_arrays(work, state.round) if state.round else None
        arrays = saved or [a.copy() for a in self.start]
        if state.pending is not None and state.pending > state.round:  # accounted, never adopted
            state.records.append(
                {"round": state.pending, "accepted": False, "reason": "killed before adoption"}
            )
            state.round, state.pending = state.pending, None
            _save(work, state, arrays)
        if state.initial_loss is None:
            state.initial_loss = self.evaluate(arrays)
        s = indicator_value(settings.user_dp.clipping_norm)
        for server_round in range(state.round + 1, settings.rounds + 1):
            started = time.monotonic()
            draw = rng if rng is not None else entropy_rng()
            cohort = poisson_cohort(mechanism.population, mechanism.sample_rate, draw)
            record: dict[str, Any] = {"round": server_round, "sampled": int(len(cohort)), "accepted": False}
            record.update(mechanism.describe())
            total: list[np.ndarray] | None = None
            for i in cohort:
                parts = self.contribution(int(i), arrays, settings, server_round)
                if total is None:
                    total = [np.asarray(p, np.float64) for p in parts]
                else:
                    for t, p in zip(total, parts, strict=True):
                        t += np.asarray(p, np.float64)
            a1 = 0 if total is None else round(float(total[-1].reshape(-1)[0]) / s)
            if total is None:
                record["reason"] = "no node was sampled"
            elif a1 < settings.min_participants:
                record["reason"] = f"fewer real A.1 updates than min_participants={settings.min_participants}"
            else:
                *update, a1_mean = release_arrays(total, mechanism, draw)
                epsilons = ledger.record(mechanism.step())
                write_ahead(work, STATE, state, server_round, ledger)  # the spend before adoption
                arrays = [g + u.astype(np.float32) for g, u in zip(arrays, update, strict=True)]
                record.update(
                    accepted=True,
                    epsilon_a1_user_level=None if settings.no_privacy else epsilons["epsilon_a1_user_level"],
                    a1_contributions_noised=float(a1_mean.reshape(-1)[0]) * mechanism.expected_cohort / s,
                )
                last = server_round == settings.rounds
                if last or (evaluate_every and server_round % evaluate_every == 0):
                    record["heldout_loss"] = self.evaluate(arrays)
            if not record["accepted"]:
                ledger.rounds.append({"round": server_round, "delta": settings.delta, "released": False})
            record["seconds"] = time.monotonic() - started
            state.seconds += record["seconds"]
            state.round, state.pending = server_round, None
            state.records.append(record)
            state.ledger = asdict(ledger)
            _save(work, state, arrays)
            if progress:
                progress(record)
        if state.records and "heldout_loss" not in state.records[-1]:
            state.records[-1]["heldout_loss"] = self.evaluate(arrays)
            _save(work, state, arrays)
        return state


def local_settings(settings: FederatedConfig, server_round: int) -> LocalTrainingConfig:
    """The recipe a client builds from the fit config (``client.Contributor.fit``), plain SGD."""
    return LocalTrainingConfig(
        settings.local, settings.local_dp, seed=settings.seed + server_round, private=False
    )


def check_simulable(settings: FederatedConfig, population: Population) -> None:
    """ConfigError unless the simulator runs exactly what the Flower path would."""
    if settings.local_dp.on_devices:
        raise ConfigError(
            "federated.local_dp.on_devices",
            "the simulator runs plain local SGD (user-level DP alone): "
            "set federated.local_dp.on_devices=false",
        )
    if "A2_anonymized" in population.tiers_present():
        raise ConfigError(
            "federated.simulation.population",
            "the simulator covers A.1 populations: drop A2_anonymized from the tiers",
        )
    if settings.nodes() != population.size + 1:
        raise ConfigError(
            "federated.user_dp.population_size",
            f"{settings.nodes()} is not the simulated nodes ({population.size} contributors + the A.2 node): "
            "leave it 0 for a simulation",
        )


def _load(work: Path) -> SimulationState:
    path = work / STATE
    return SimulationState(**json.loads(path.read_text())) if path.exists() else SimulationState()


def _save(work: Path, state: SimulationState, arrays: list[np.ndarray]) -> None:
    save_round(work, STATE, state, state.round, arrays)
