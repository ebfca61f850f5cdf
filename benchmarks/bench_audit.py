"""Empirical privacy beside the theoretical epsilon (issue 14, item 5), the closing note's figures:

- user level (A.1): the one-run audit (Steinke et al. 2023) of DP-FedAvg with random-direction
  canary contributors (Andrew et al. 2024) at N = 10^4, q = 0.01, T = 200, delta = 1e-6, for noise
  multipliers calibrated to epsilon 1, 3 and 8, and the z = 0 control (no guarantee: the audit's
  power). Every lower bound must stay under its theoretical epsilon;
- record level (A.2 DP-SGD): Secret-Sharer exposure of canaries planted 1, 4 and 16 times among
  the pool's lines, after the A.2 node's DP-SGD and after a non-DP control on the same lines, on a
  tiny pretrained model, among 10^4 references (smoke: 50).

One process, torch on one thread (a 64-wide model gains nothing from more).
``python -m benchmarks.bench_audit [--smoke]``
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
import warnings
from pathlib import Path

import torch

from nimmer_train.config.federated import LocalDPConfig, LocalRecipeConfig
from nimmer_train.federation.client import example_text
from nimmer_train.federation.exposure_audit import canary_exposure
from nimmer_train.federation.local_training import LocalTrainingConfig
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.audit import audit_user_level
from nimmer_train.privacy.dp_fedavg import Mechanism, noise_multiplier_for
from tests.helpers.tiny_lm import pretrained_release

TARGETS = (1.0, 3.0, 8.0)


def calibrated(
    target: float, population: int, rate: float, rounds: int, delta: float, precision: float = 1e-9
) -> Mechanism:
    """The mechanism whose accounted epsilon is ``target`` (z to within ``precision``)."""
    z = noise_multiplier_for(target, rate, rounds, delta, precision)
    return Mechanism(population, rate, z, 1.0, rounds, delta)


def user_level(smoke: bool) -> dict[str, object]:
    population, rate, rounds = (200, 0.05, 5) if smoke else (10_000, 0.01, 200)
    canaries, dim = (100, 200) if smoke else (2_000, 10_000)
    # smoke: one target, z to within 0.1 (the calibration is most of its seconds)
    targets, precision = ((8.0,), 0.1) if smoke else (TARGETS, 1e-9)
    figures: dict[str, object] = {
        "user_population": population,
        "user_sample_rate": rate,
        "user_rounds": rounds,
    }
    figures.update({"user_canaries": canaries, "user_dim": dim, "user_delta": 1e-6})
    mechanisms = {f"eps{t:g}": calibrated(t, population, rate, rounds, 1e-6, precision) for t in targets}
    mechanisms["z0"] = Mechanism(population, rate, 0.0, 1.0, rounds, 1e-6)
    for name, mechanism in mechanisms.items():
        start = time.perf_counter()
        audit = audit_user_level(mechanism, canaries, dim)
        figures[f"user_{name}_z"] = round(mechanism.noise_multiplier, 4)
        figures[f"user_{name}_theory"] = audit.theoretical_epsilon
        figures[f"user_{name}_lower_bound"] = round(audit.lower_bound, 3)
        figures[f"user_{name}_guesses_correct"] = f"{audit.correct}/{audit.guesses}"
        figures[f"user_{name}_s"] = round(time.perf_counter() - start, 2)
    figures["user_bounds_valid"] = all(
        figures[f"user_eps{t:g}_lower_bound"] <= figures[f"user_eps{t:g}_theory"] for t in targets
    )
    return figures


def record_level(smoke: bool) -> dict[str, object]:
    steps, references, per_count, rounds = (2, 50, 1, 1) if smoke else (500, 10_000, 5, 2)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        base, adapter = pretrained_release(Path(tmp), 2 if smoke else 150)
        pool = [example_text(e) for e in heldout_examples(16, seed=4)]
        dp = LocalTrainingConfig(
            LocalRecipeConfig(
                steps=steps // 2,
                batch_size=16,
                lr=3.0,
                max_length=48,
                max_examples=len(pool) + 21 * per_count + 4,
            ),
            LocalDPConfig(noise_multiplier=1.0, max_grad_norm=0.1, grad_sample_mode="hooks"),
            seed=0,
            public_rate=True,
        )
        control = dataclasses.replace(
            dp,
            recipe=dataclasses.replace(dp.recipe, lr=1.0),
            dp=dataclasses.replace(dp.dp, noise_multiplier=0.0, max_grad_norm=1.0),
        )
        report = canary_exposure(
            base, adapter, pool, dp, rounds=rounds, delta=1e-5, per_count=per_count, references=references,
            control=control,
        )  # fmt: skip
        elapsed = time.perf_counter() - start
    figures = {f"record_{k}": v for k, v in report.record().items() if not k.startswith(("dp_", "control_"))}
    figures.update({k: v for k, v in report.record().items() if "exposure" in k or k == "dp_epsilon"})
    figures["dp_exposure_up_to_4x"] = report.mean("dp", up_to=4)
    figures["control_exposure_up_to_4x"] = report.mean("control", up_to=4)
    figures["dp_exposure_mean"] = report.mean("dp")
    figures["control_exposure_mean"] = report.mean("control")
    figures["record_steps"] = steps
    figures["record_s"] = round(elapsed, 1)
    figures["dp_exposures"] = [round(v, 2) for v in report.dp]
    figures["control_exposures"] = [round(v, 2) for v in report.control]
    return figures


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        user, record = user_level(smoke), record_level(smoke)
    finally:
        torch.set_num_threads(threads)
    return {
        "user_eps8_audit_to_theory_ratio": user["user_eps8_lower_bound"] / user["user_eps8_theory"],
        "exposure_control_to_dp_ratio": record["control_exposure_mean"] / record["dp_exposure_mean"],
        "goal": (
            "every user-level audit lower bound <= its theoretical epsilon, the z = 0 control's >= 3; "
            "DP mean exposure <= 3 bits for canaries planted <= 4 times, the non-DP control clearly higher"
        ),
        **user,
        **record,
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
