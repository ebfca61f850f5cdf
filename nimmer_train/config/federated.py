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
SIMULATION_ONLY = ("enabled", "register", "contributors", "population", "entries_per_player", "faults")


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
    entries_per_player: int = 60
    seed: int = 0
    faults: list[str] = field(default_factory=list)  # simulation drills: "<fault>@<partition>.<round>"

    def __post_init__(self) -> None:
        for name in ("rounds", "min_participants", "local_steps", "batch_size", "max_length", "a2_k"):
            if getattr(self, name) < 1:
                raise ConfigError(f"federated.{name}", "must be >= 1")
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
        if self.secure_aggregation and self.contributors + 1 > SECAGG_MAX_NODES:
            raise ConfigError(
                "federated.contributors",
                f"{self.contributors} contributors and the A.2 node make {self.contributors + 1} SecAgg+ "
                f"nodes; SecAgg+'s masked sum overflows its modulus 2^32 at 1024 (quantisation range 2^22 "
                f"per node): at most {SECAGG_MAX_NODES} nodes per round",
            )
        for tier in self.population:
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
            if name in ("register", "adapter_dir") and value == "":
                value = None
            if name == "epsilon_budget" and value == 0:
                value = None  # run configs have no null: 0 means no budget
            values[name] = value
        return cls(**values)
