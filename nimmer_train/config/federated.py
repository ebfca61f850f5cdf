"""Federation settings: the one source of the Hydra group ``federated``, of the Flower app's run
config and of the fit config the server sends its nodes, so simulation and deployment read the
same values under the same names.

The settings come in groups (``secagg``, ``user_dp``, ``local``, ``local_dp``, ``a2``, ``audit``,
``simulation``) over a few top-level ones. A setting keeps its name everywhere: Hydra's
``federated.user_dp.noise_multiplier`` is ``user-dp.noise-multiplier`` in the run config
(``flwr run federated --run-config 'user-dp.noise-multiplier=0.5'``: Flower flattens nested TOML
tables and dotted keys to exactly this form) and in the fit config. Each group writes and reads
its own keys (:meth:`Group.to_fit_config`, :meth:`Group.from_fit_config`), derived from its
field names: no key list is kept by hand.

The defaults live only here. ``federated/pyproject.toml``'s ``[tool.flwr.app.config]`` table,
which Flower needs to know the keys, is generated from these dataclasses by
:mod:`nimmer_train.config.flower_app` (a test fails while it is stale).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any, ClassVar, Self

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
# fields no deployment reads (a group: all of it): a deployed server starts from adapter-dir
SIMULATION_ONLY = ("enabled", "register", "start_rank", "start_layers", "start_targets", "simulation")


def dashed(name: str) -> str:
    """A field name as a run-config or fit-config key: ``noise_multiplier`` -> ``noise-multiplier``."""
    return name.replace("_", "-")


def _to_scalar(f: Field[Any], value: Any) -> Any:
    """Run and fit configs hold scalars only: lists as JSON text, null as "" (0.0 for a number)."""
    if isinstance(value, list):
        return json.dumps(value)
    if value is None:
        return 0.0 if str(f.type).startswith("float") else ""
    return value


def _from_scalar(f: Field[Any], key: str, value: Any) -> Any:
    """The field's value from its scalar form (:func:`_to_scalar`); a wrong type is a ConfigError."""
    kind = str(f.type)
    base = kind.split(" | ")[0]
    try:
        if base.startswith("list"):
            items = json.loads(value) if isinstance(value, str) else value
            if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
                raise TypeError
            return items
        if kind.endswith("| None") and not isinstance(value, bool) and value in ("", 0):
            return None  # run configs have no null
        if base == "bool" or isinstance(value, bool):
            if base != "bool" or not isinstance(value, bool):
                raise TypeError
            return value
        if base == "int" and float(value) != int(float(value)):
            raise ValueError
        return {"int": lambda v: int(float(v)), "float": float, "str": str}[base](value)
    except (TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ConfigError(key, f"want {kind}, got {value!r}") from exc


class Group:
    """A settings group: its keys in run and fit configs are ``KEY.<field, dashed>``."""

    KEY: ClassVar[str]

    def to_fit_config(self) -> dict[str, Any]:
        return {f"{self.KEY}.{dashed(f.name)}": _to_scalar(f, getattr(self, f.name)) for f in fields(self)}  # type: ignore[arg-type]

    @classmethod
    def from_fit_config(cls, config: Mapping[str, Any]) -> Self:
        """The group from a fit or run config's keys; a key it lacks takes the schema's default."""
        values = {}
        for f in fields(cls):  # type: ignore[arg-type]
            key = f"{cls.KEY}.{dashed(f.name)}"
            if key in config:
                values[f.name] = _from_scalar(f, key, config[key])
        return cls(**values)


@dataclass
class SecAggConfig(Group):
    """SecAgg+: the server only sees the sum of the masked contributions."""

    KEY: ClassVar[str] = "secagg"
    enabled: bool = True  # false: plain FedAvg (simulation only: a deployed client always masks)
    # key shares per node (itself and its ring neighbours) and the shares needed to unmask;
    # <= 1: a fraction of the nodes sampled (1.0: every node, the most dropout-tolerant), > 1: a count
    shares: float = 1.0
    threshold: float = 0.5

    def __post_init__(self) -> None:
        if self.shares > 1 and (self.shares % 2 == 0 or self.shares != int(self.shares)):
            raise ConfigError(
                "federated.secagg.shares", "a count must be odd (the node and pairs of neighbours)"
            )
        if self.shares <= 0 or self.threshold <= 0:
            raise ConfigError("federated.secagg.shares", "shares and threshold must be > 0")
        if (self.shares > 1) == (self.threshold > 1) and self.threshold > self.shares:
            raise ConfigError("federated.secagg.threshold", "cannot exceed federated.secagg.shares")

    def flower_args(self) -> tuple[int | float, int | float]:
        """(num_shares, reconstruction_threshold) as Flower reads them: a float is a fraction."""
        return tuple(v if v <= 1 else int(v) for v in (self.shares, self.threshold))  # type: ignore[return-value]


@dataclass
class UserDPConfig(Group):
    """A.1 user-level DP-FedAvg: nodes Poisson-sampled at rate q from N, each contribution clipped
    to C on the client, N(0, (z C)^2) on the sum at the server, released over the fixed q N."""

    KEY: ClassVar[str] = "user-dp"
    # N: every released mean is (clipped sum + noise) / (q N), a fixed denominator, never the
    # survivors; 0: the simulated nodes (contributors + the A.2 node). A deployment sets it to the
    # population its SuperNodes are drawn from.
    population_size: int = 0
    fraction_fit: float = 1.0  # q: the share of the nodes sampled per round
    clipping_norm: float = 10.0  # C: local DP-SGD noise dominates an update's norm; clip above it
    noise_multiplier: float = 1.0  # z; 0 only with no_privacy

    def __post_init__(self) -> None:
        if self.population_size < 0:
            raise ConfigError("federated.user_dp.population_size", "must be >= 0 (0: the simulated nodes)")
        if not 0 < self.fraction_fit <= 1:
            raise ConfigError("federated.user_dp.fraction_fit", "must be in (0, 1]")
        if self.clipping_norm <= 0:
            raise ConfigError("federated.user_dp.clipping_norm", "must be > 0")
        if self.noise_multiplier < 0:
            raise ConfigError("federated.user_dp.noise_multiplier", "must be >= 0")


@dataclass
class LocalRecipeConfig(Group):
    """The local training recipe of every node (A.1 devices and the server-operated A.2 client)."""

    KEY: ClassVar[str] = "local"
    steps: int = 6
    batch_size: int = 16
    lr: float = 3.0  # SGD on clipped per-sample gradients: the step is lr * local_dp.max_grad_norm
    max_length: int = 48  # tokens per example
    # examples a device trains on at most; the A.2 pool trains on all of its examples at the public
    # Poisson rate batch_size / max_examples (its size stays out of its epsilon)
    max_examples: int = 256
    # plain local SGD's matmuls (local_dp.on_devices=false): bfloat16 autocast over float32 weights
    # where the device's CPU multiplies it natively, as lora.dtype; DP-SGD (Opacus) stays float32
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "max_length"):
            if getattr(self, name) < 1:
                raise ConfigError(f"federated.local.{name}", "must be >= 1")
        if self.dtype not in ("float32", "bfloat16"):
            raise ConfigError("federated.local.dtype", f"float32 or bfloat16, not {self.dtype!r}")


@dataclass
class LocalDPConfig(Group):
    """Local DP-SGD (Opacus): always on the server-operated A.2 client, on A.1 devices unless
    ``on_devices`` is false (a record-level layer under the user-level noise)."""

    KEY: ClassVar[str] = "local-dp"
    # false: plain local SGD on A.1 devices (deterministic given the round's seed), the user-level
    # mechanism alone
    on_devices: bool = True
    noise_multiplier: float = 1.0  # 0 only with no_privacy
    max_grad_norm: float = 0.1  # per-example clip
    grad_sample_mode: str = "hooks"  # hooks | ghost (Opacus ghost clipping)

    def __post_init__(self) -> None:
        if self.noise_multiplier < 0:
            raise ConfigError("federated.local_dp.noise_multiplier", "must be >= 0")
        if self.grad_sample_mode not in ("hooks", "ghost"):
            raise ConfigError("federated.local_dp.grad_sample_mode", "must be hooks or ghost")


@dataclass
class A2Config(Group):
    """The A.2 anonymised pool (its DP-SGD is ``local_dp``'s): its k and the noised release of its
    counts. The counts' noise keeps its ``count_`` prefix: ``a2.noise_multiplier`` would read as
    the pool's DP-SGD noise."""

    KEY: ClassVar[str] = "a2"
    k: int = 2  # the intake refuses to train with fewer uploads than this
    # the pool's published counts (uploads, examples per category): Gaussian noise of std
    # count_noise_multiplier * sqrt(2) on each, one step of the A.2 record-level ledger
    count_noise_multiplier: float = 5.0  # 0 only with no_privacy

    def __post_init__(self) -> None:
        if self.k < 1:
            raise ConfigError("federated.a2.k", "must be >= 1")
        if self.count_noise_multiplier < 0:
            raise ConfigError("federated.a2.count_noise_multiplier", "must be >= 0")


@dataclass
class AuditConfig(Group):
    """The record-level audit (issue 14): Secret-Sharer canaries planted 1, 4 and 16 times among
    the A.2 pool's lines, the A.2 node's DP-SGD over the released rounds and a non-DP control,
    each canary ranked among ``references`` candidates; 0 canaries: no audit."""

    KEY: ClassVar[str] = "audit"
    canaries: int = 4  # canaries per planting count
    references: int = 10_000  # reference candidates per canary (exposure at most log2 of it)
    control_steps: int = 0  # the control's local steps per round; 0: the run's local.steps

    def __post_init__(self) -> None:
        for name in ("canaries", "control_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(
                    f"federated.audit.{name}", "must be >= 0 (0: no canary audit / the run's steps)"
                )
        if not 1 <= self.references < 10**6:
            raise ConfigError(
                "federated.audit.references", "must be in [1, 10^6): the secrets' space is 10^6"
            )


@dataclass
class SimulationConfig(Group):
    """The simulated population: virtual contributors built from synthetic players."""

    KEY: ClassVar[str] = "simulation"
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
    # how a virtual player's memory store is indexed as it is built: "sentence" (all-MiniLM-L6-v2,
    # as a real device) or "sketch" (hashed trigrams, no model: the federation reads the stores'
    # texts, never searches their vectors; embedding was 42 % of a sampled node's time at cohort 100)
    embedder: str = "sentence"
    faults: list[str] = field(default_factory=list)  # drills: "<fault>@<partition>.<round>"
    # the simulation engine's CPUs, one virtual node running per CPU (each a Ray actor that loads
    # the model stack); 0: the machine's cores, at most 4
    cpus: int = 0

    def __post_init__(self) -> None:
        if self.cpus < 0:
            raise ConfigError("federated.simulation.cpus", "must be >= 0 (0: the machine's cores, at most 4)")
        if self.embedder not in ("sentence", "sketch"):
            raise ConfigError("federated.simulation.embedder", f"sentence or sketch, not {self.embedder!r}")
        for tier in [*self.population, *([self.population_rest] if self.population_rest else [])]:
            if tier not in TIER_CHOICES:
                raise ConfigError(
                    "federated.simulation.population", f"{tier!r} is not one of {', '.join(TIER_CHOICES)}"
                )
        for drill in self.faults:
            match = re.fullmatch(r"(\w+)@\d+\.\d+", drill)
            if not match or match.group(1) not in FAULTS:
                raise ConfigError(
                    "federated.simulation.faults",
                    f"{drill!r}: want <fault>@<partition>.<round>, a fault in {', '.join(FAULTS)}",
                )

    def drills(self) -> dict[int, dict[int, str]]:
        """{partition: {round: fault}} from ``faults``."""
        out: dict[int, dict[int, str]] = {}
        for drill in self.faults:
            fault, where = drill.split("@")
            partition, server_round = (int(x) for x in where.split("."))
            out.setdefault(partition, {})[server_round] = fault
        return out


@dataclass
class FederatedConfig:
    """Rounds, participation and accounting, over the groups of the mechanisms and the simulation."""

    enabled: bool = True  # run_all runs a federation after the register LoRAs
    register: str | None = None  # the register adapter the federation improves; null: the first trained
    adapter_dir: str | None = None  # start from this adapter folder; null: the one train_loras made
    # > 0: start from a fresh LoRA of this rank (B = 0: the base's own outputs) on the top
    # start_layers layers' start_targets instead of the register's adapter. Its size sets the
    # noise's norm (z C / (q N) a coordinate) and how far back a client's backward pass runs; merged
    # into a version it is the population's change to the base, not a register's voice
    start_rank: int = 0
    start_layers: int = 2
    start_targets: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    rounds: int = 2
    min_participants: int = 3  # fewer real A.1 updates in a round's sum than this: no update
    round_timeout: float = 300.0  # seconds a node may take per SecAgg+ stage before it counts as gone
    # accounting
    delta: float = 1.0e-5
    epsilon_budget: float | None = None  # stop before a round that would pass it (A.1 or A.2)
    no_privacy: bool = False  # an experiment without DP: noise multipliers may be 0, no epsilon published
    # server-side held-out evaluation: a synthetic player generated on the server, never a contributor
    heldout_examples: int = 64
    seed: int = 0  # data order and initialisation on the nodes, the simulated players; never DP noise
    secagg: SecAggConfig = field(default_factory=SecAggConfig)
    user_dp: UserDPConfig = field(default_factory=UserDPConfig)
    local: LocalRecipeConfig = field(default_factory=LocalRecipeConfig)
    local_dp: LocalDPConfig = field(default_factory=LocalDPConfig)
    a2: A2Config = field(default_factory=A2Config)
    audit: AuditConfig = field(default_factory=AuditConfig)
    simulation: SimulationConfig = field(default_factory=SimulationConfig)

    def __post_init__(self) -> None:
        for name in ("rounds", "min_participants"):
            if getattr(self, name) < 1:
                raise ConfigError(f"federated.{name}", "must be >= 1")
        if not 0 < self.delta < 1:
            raise ConfigError("federated.delta", "must be in (0, 1)")
        if self.start_rank < 0 or self.start_layers < 1 or not self.start_targets:
            raise ConfigError(
                "federated.start_rank",
                "start_rank >= 0 (0: the register's adapter), start_layers >= 1, start_targets non-empty",
            )
        self._check_noise()
        q = self.user_dp.fraction_fit
        cohort = q * self.nodes()
        spread = 4 * (cohort * (1 - q)) ** 0.5  # Poisson cohorts vary: 4 std
        if self.secagg.enabled and cohort + spread > SECAGG_MAX_NODES:
            raise ConfigError(
                "federated.user_dp.fraction_fit",
                f"an expected cohort of {cohort:g} nodes (q={q:g} of {self.nodes()}) would "
                f"often pass SecAgg+'s {SECAGG_MAX_NODES} nodes per round (its masked sum overflows its "
                "modulus 2^32 at 1024, quantisation range 2^22 per node): lower "
                "federated.user_dp.fraction_fit",
            )

    def _check_noise(self) -> None:
        """Every DP mechanism's noise multiplier is > 0, unless ``no_privacy`` says this
        experiment makes no privacy claim (then no epsilon is published and no budget applies)."""
        noises = {
            "user_dp.noise_multiplier": self.user_dp.noise_multiplier,
            "local_dp.noise_multiplier": self.local_dp.noise_multiplier,
            "a2.count_noise_multiplier": self.a2.count_noise_multiplier,
        }
        for name, value in noises.items():
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
        return self.user_dp.population_size or self.simulation.contributors + 1

    def fit_config(self) -> dict[str, Any]:
        """What every node reads of the settings each round: the local recipe and its DP-SGD, the
        A.2 pool's k, the user-level mechanism (a device computes the federation's epsilon from
        its z and q), ``delta``, and ``seed``, which drives only data order and initialisation on
        the nodes, never their DP noise or sampling masks."""
        groups = (self.local, self.local_dp, self.a2, self.user_dp)
        return {
            "seed": self.seed,
            "delta": self.delta,
            **{k: v for g in groups for k, v in g.to_fit_config().items()},
        }

    def to_run_config(self) -> dict[str, Any]:
        """Flower run-config form: top-level keys dashed, a group's as ``group.key``, scalars only."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            out.update(
                value.to_fit_config() if isinstance(value, Group) else {dashed(f.name): _to_scalar(f, value)}
            )
        return out

    @classmethod
    def from_run_config(cls, run_config: Mapping[str, Any]) -> FederatedConfig:
        """Read the run-config keys this app knows (the places are the deployed app's); an
        unknown key is an error."""
        known = set(cls().to_run_config())
        for key in run_config:
            if key not in known and key.replace("-", "_") not in PLACES:
                raise ConfigError(f"run-config {key}", f"unknown key; known: {', '.join(sorted(known))}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            group = f.default_factory
            if isinstance(group, type) and issubclass(group, Group):
                values[f.name] = group.from_fit_config(run_config)
            elif dashed(f.name) in run_config:
                values[f.name] = _from_scalar(f, dashed(f.name), run_config[dashed(f.name)])
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
    # cells whose noise swamps the update: each must score below goal_share, or the table could not
    # show a failure (issue 43); run where N is one of the populations. 0.2 is about the smallest
    # epsilon Opacus's RDP accountant reaches (z = 7.7 at q = 0.1, T = 10: 3.6x epsilon 1's noise)
    control_cells: list[str] = field(default_factory=lambda: ["0.2@1000"])

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
        for spec in self.control_cells:
            eps, _, n = spec.partition("@")
            try:
                ok = 0 < float(eps) < math.inf and int(n) >= 2
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(
                    "privacy_sweep.control_cells", f"{spec!r}: write epsilon@N (a finite epsilon > 0, N >= 2)"
                )
