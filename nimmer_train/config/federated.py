"""Federation settings: the one source of the Hydra group ``federated`` and of the Flower app's
run config (``flwr run federated --run-config 'rounds=3 ...'`` uses the same field names, with
dashes), so simulation and deployment read the same values.

The defaults live only here. ``federated/pyproject.toml``'s ``[tool.flwr.app.config]`` table,
which Flower needs to know the keys, is generated from this dataclass by
:mod:`nimmer_train.config.flower_app` (a test fails while it is stale).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from nimmer_train.errors import ConfigError

TIER_CHOICES = ("A1_federated", "A2_anonymized", "opt_out")
# SecAgg+ (flwr's SecAggPlusWorkflow): each node quantises every coordinate to an integer in
# [0, QUANTIZATION_RANGE] and its weight factor to QUANTIZATION_RANGE (max_weight 1); the server
# sums them modulo MODULUS_RANGE. n nodes' sum stays below the modulus only while
# n * QUANTIZATION_RANGE < MODULUS_RANGE: at 1024 nodes (2^32 / 2^22) the weight factors alone
# sum to 2^32 = 0 and the aggregate overflows. Flower documents the modulus as at most 2^32, so it
# is not widened: a round never takes more than SECAGG_MAX_NODES nodes.
SECAGG_QUANTIZATION_RANGE = 2**22
SECAGG_MODULUS_RANGE = 2**32
SECAGG_MAX_NODES = SECAGG_MODULUS_RANGE // SECAGG_QUANTIZATION_RANGE - 1  # 1023
FAULTS = ("crash", "nan", "wrong_shape", "wrong_dtype")
PLACES = ("base_dir", "work_dir", "out_dir", "a2_pool", "tracking_uri")  # deployed server's run config
SIMULATION_ONLY = (
    "enabled",
    "register",
    "contributors",
    "population",
    "population_rest",
    "entries_per_player",
    "faults",
    "simulation_cpus",
)


@dataclass
class FederatedConfig:
    """Rounds, participation, the two DP mechanisms, accounting and the simulated population."""

    enabled: bool = True  # run_all runs a federation after the register LoRAs
    register: str | None = None  # the register adapter the federation improves; null: the first trained
    adapter_dir: str | None = None  # start from this adapter folder; null: the one train_loras made
    rounds: int = 2
    # participation (robustness)
    min_participants: int = 3  # fewer surviving contributors than this: the round makes no update
    fraction_fit: float = 1.0  # share of the nodes sampled per round (the q of user-level accounting)
    # N of the user-level mechanism: every released mean is (clipped sum + noise) / (q N), a fixed
    # denominator, never the survivors; 0: the simulated nodes (contributors + the A.2 node). A
    # deployment sets it to the population its SuperNodes are drawn from.
    population_size: int = 0
    round_timeout: float = 300.0  # seconds a node may take per SecAgg+ stage before it counts as gone
    secure_aggregation: bool = True  # SecAgg+ (the server only sees the sum); false: plain FedAvg
    # SecAgg+ key shares per node (itself and its ring neighbours) and the shares needed to unmask;
    # <= 1: a fraction of the nodes sampled (1.0: every node, the most dropout-tolerant), > 1: a count
    secagg_shares: float = 1.0
    secagg_threshold: float = 0.5
    # A.1 user-level DP: clipped on the client, Gaussian noise on the sum at the server
    clipping_norm: float = 10.0  # local DP-SGD noise dominates an update's norm; clip above it
    noise_multiplier: float = 1.0  # 0 only with no_privacy
    # local DP-SGD, on every A.1 device and on the server-operated A.2 client
    local_steps: int = 6
    batch_size: int = 16
    lr: float = 3.0  # SGD on clipped per-sample gradients: the step is lr * dp_max_grad_norm
    max_length: int = 48  # tokens per example
    # examples a device trains on at most; the A.2 pool trains on all of its examples at the public
    # Poisson rate batch_size / max_examples (its size stays out of its epsilon)
    max_examples: int = 256
    # local DP-SGD on A.1 devices (a record-level layer under the user-level noise); false: plain
    # local SGD on the device (deterministic given the round's seed), the user-level mechanism alone
    local_dp: bool = True
    dp_noise_multiplier: float = 1.0  # 0 only with no_privacy
    dp_max_grad_norm: float = 0.1
    grad_sample_mode: str = "hooks"  # hooks | ghost (Opacus ghost clipping)
    # A.2 anonymised pool
    a2_k: int = 2  # the intake refuses to train with fewer uploads than this
    # the pool's published counts (uploads, examples per category): Gaussian noise of std
    # count_noise_multiplier * sqrt(2) on each, one step of the A.2 record-level ledger
    count_noise_multiplier: float = 5.0  # 0 only with no_privacy
    # accounting
    delta: float = 1.0e-5
    epsilon_budget: float | None = None  # stop before a round that would pass it (A.1 or A.2)
    no_privacy: bool = False  # an experiment without DP: noise multipliers may be 0, no epsilon published
    # record-level audit (issue 14): Secret-Sharer canaries planted 1, 4 and 16 times among the A.2
    # pool's lines, the A.2 node's DP-SGD over the released rounds and a non-DP control, each
    # canary ranked among exposure_references candidates; 0 canaries: no audit
    exposure_canaries: int = 4  # canaries per planting count
    exposure_references: int = 10_000  # reference candidates per canary (exposure at most log2 of it)
    exposure_control_steps: int = 0  # the control's local steps per round; 0: the run's local_steps
    # server-side held-out evaluation: a synthetic player generated on the server, never a contributor
    heldout_examples: int = 64
    # simulation: virtual contributors built from synthetic players
    contributors: int = 6
    population: list[str] = field(
        default_factory=lambda: [
            "A1_federated",
            "A1_federated",
            "A2_anonymized",
            "A1_federated",
            "opt_out",
            "A2_anonymized",
        ]
    )
    # tier of the contributors past the ``population`` list (a large population with a few A2
    # uploads: the list, then A1_federated); null: the list repeats
    population_rest: str | None = None
    entries_per_player: int = 60
    seed: int = 0
    faults: list[str] = field(default_factory=list)  # simulation drills: "<fault>@<partition>.<round>"
    # the simulation engine's CPUs, one virtual node running per CPU (each a Ray actor that loads
    # the model stack); 0: the machine's cores, at most 4
    simulation_cpus: int = 0

    def __post_init__(self) -> None:
        for name in ("rounds", "min_participants", "local_steps", "batch_size", "max_length", "a2_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"federated.{name}", "must be >= 1")
        if self.simulation_cpus < 0:
            raise ConfigError("federated.simulation_cpus", "must be >= 0 (0: the machine's cores, at most 4)")
        for name in ("exposure_canaries", "exposure_control_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"federated.{name}", "must be >= 0 (0: no canary audit / the run's steps)")
        if not 1 <= self.exposure_references < 10**6:
            raise ConfigError(
                "federated.exposure_references", "must be in [1, 10^6): the secrets' space is 10^6"
            )
        if not 0 < self.fraction_fit <= 1:
            raise ConfigError("federated.fraction_fit", "must be in (0, 1]")
        if self.clipping_norm <= 0:
            raise ConfigError("federated.clipping_norm", "must be > 0")
        self._check_noise()
        if not 0 < self.delta < 1:
            raise ConfigError("federated.delta", "must be in (0, 1)")
        if self.grad_sample_mode not in ("hooks", "ghost"):
            raise ConfigError("federated.grad_sample_mode", "must be hooks or ghost")
        if self.secagg_shares > 1 and (
            self.secagg_shares % 2 == 0 or self.secagg_shares != int(self.secagg_shares)
        ):
            raise ConfigError(
                "federated.secagg_shares", "a count must be odd (the node and pairs of neighbours)"
            )
        if self.secagg_shares <= 0 or self.secagg_threshold <= 0:
            raise ConfigError("federated.secagg_shares", "shares and threshold must be > 0")
        if (self.secagg_shares > 1) == (
            self.secagg_threshold > 1
        ) and self.secagg_threshold > self.secagg_shares:
            raise ConfigError("federated.secagg_threshold", "cannot exceed federated.secagg_shares")
        if self.population_size < 0:
            raise ConfigError("federated.population_size", "must be >= 0 (0: the simulated nodes)")
        cohort = self.fraction_fit * self.nodes()
        spread = 4 * (cohort * (1 - self.fraction_fit)) ** 0.5  # Poisson cohorts vary: 4 std
        if self.secure_aggregation and cohort + spread > SECAGG_MAX_NODES:
            raise ConfigError(
                "federated.fraction_fit",
                f"an expected cohort of {cohort:g} nodes (q={self.fraction_fit:g} of {self.nodes()}) would "
                f"often pass SecAgg+'s {SECAGG_MAX_NODES} nodes per round (its masked sum overflows its "
                "modulus 2^32 at 1024, quantisation range 2^22 per node): lower federated.fraction_fit",
            )
        for tier in [*self.population, *([self.population_rest] if self.population_rest else [])]:
            if tier not in TIER_CHOICES:
                raise ConfigError("federated.population", f"{tier!r} is not one of {', '.join(TIER_CHOICES)}")
        for drill in self.faults:
            match = re.fullmatch(r"(\w+)@\d+\.\d+", drill)
            if not match or match.group(1) not in FAULTS:
                raise ConfigError(
                    "federated.faults",
                    f"{drill!r}: want <fault>@<partition>.<round>, a fault in {', '.join(FAULTS)}",
                )

    def _check_noise(self) -> None:
        """Every DP mechanism's noise multiplier is > 0, unless ``no_privacy`` says this
        experiment makes no privacy claim (then no epsilon is published and no budget applies)."""
        noises = {
            "noise_multiplier": self.noise_multiplier,
            "dp_noise_multiplier": self.dp_noise_multiplier,
            "count_noise_multiplier": self.count_noise_multiplier,
        }
        for name, value in noises.items():
            if value < 0:
                raise ConfigError(f"federated.{name}", "must be >= 0")
            if value == 0 and not self.no_privacy:
                raise ConfigError(
                    f"federated.{name}",
                    "0 means no noise and no privacy guarantee (epsilon infinite); use a noise multiplier "
                    "> 0, or set federated.no_privacy=true for an experiment that publishes no epsilon",
                )
        if self.no_privacy and self.epsilon_budget is not None:
            raise ConfigError(
                "federated.epsilon_budget", "a budget means nothing with federated.no_privacy=true"
            )

    def nodes(self) -> int:
        """N: the population the user-level mechanism's fixed denominator q N assumes."""
        return self.population_size or self.contributors + 1

    def drills(self) -> dict[int, dict[int, str]]:
        """{partition: {round: fault}} from ``faults``."""
        out: dict[int, dict[int, str]] = {}
        for drill in self.faults:
            fault, where = drill.split("@")
            partition, server_round = (int(x) for x in where.split("."))
            out.setdefault(partition, {})[server_round] = fault
        return out

    def secagg(self) -> tuple[int | float, int | float]:
        """(num_shares, reconstruction_threshold) as Flower reads them: a float is a fraction."""
        return tuple(v if v <= 1 else int(v) for v in (self.secagg_shares, self.secagg_threshold))  # type: ignore[return-value]

    def to_run_config(self) -> dict[str, Any]:
        """Flower run-config form: dashed keys, scalars only (lists and maps as JSON text)."""
        out: dict[str, Any] = {}
        for key, value in dataclasses.asdict(self).items():
            if isinstance(value, list | dict):
                value = json.dumps(value)
            if value is None:
                value = 0.0 if key == "epsilon_budget" else ""
            out[key.replace("_", "-")] = value
        return out

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> FederatedConfig:
        """Read the dashed run-config keys this app knows; unknown keys are an error."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in run_config.items():
            name = key.replace("-", "_")
            if name in PLACES:
                continue  # where things are: read by the deployed app, not settings
            if name not in fields:
                raise ConfigError(f"run-config {key}", f"unknown key; known: {', '.join(sorted(fields))}")
            if name in ("population", "faults") and isinstance(value, str):
                value = json.loads(value)
            if name in ("register", "adapter_dir", "population_rest") and value == "":
                value = None
            if name == "epsilon_budget" and value == 0:
                value = None  # run configs have no null: 0 means no budget
            values[name] = value
        return cls(**values)


@dataclass
class PrivacySweepConfig:
    """The privacy-utility sweep (``python -m pipelines.privacy_sweep``): every (epsilon, N) cell
    runs the federation's mechanism in the simulator with ``rounds`` rounds and an expected
    cohort of ``cohort`` nodes (q = cohort / N), z calibrated so the T rounds spend epsilon at
    ``delta``; epsilon inf is the non-private run (z = 0) on the same N, q and T. Each cell runs
    ``seeds`` times (cohorts and noise; the table reports the mean share and its spread). The
    local recipe (C, lr, steps, batch) is the ``federated`` group's."""

    epsilons: list[float] = field(default_factory=lambda: [1.0, 3.0, 8.0, float("inf")])
    populations: list[int] = field(default_factory=lambda: [1_000, 10_000, 100_000])
    delta: float = 1.0e-6
    rounds: int = 10
    cohort: int = 100  # expected contributors per round, q N (the same for every N)
    seed: int = 0  # cohorts and noise of every cell of one N: paired comparisons across epsilon
    seeds: int = 3  # runs per cell, generators (seed, N, k) for k < seeds: the share's mean and spread
    evaluate_every: int = 5  # held-out loss every k rounds (and after the last)
    goal_share: float = 0.9  # of the non-private held-out loss gain
    goal_cells: list[str] = field(default_factory=lambda: ["8@10000", "3@100000"])  # epsilon@N

    def __post_init__(self) -> None:
        if not self.epsilons or any(e <= 0 for e in self.epsilons):
            raise ConfigError("privacy_sweep.epsilons", "a non-empty list of epsilons > 0 (inf: no noise)")
        if not self.populations or any(n < 2 for n in self.populations):
            raise ConfigError("privacy_sweep.populations", "a non-empty list of populations >= 2")
        if self.cohort < 1 or any(self.cohort > n for n in self.populations):
            raise ConfigError("privacy_sweep.cohort", "must be >= 1 and at most every population")
        if not 0 < self.delta < 1:
            raise ConfigError("privacy_sweep.delta", "must be in (0, 1)")
        if self.rounds < 1:
            raise ConfigError("privacy_sweep.rounds", "must be >= 1")
        if self.seeds < 1:
            raise ConfigError("privacy_sweep.seeds", "must be >= 1 (runs per cell)")
