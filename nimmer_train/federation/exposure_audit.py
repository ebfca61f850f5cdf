"""Canary exposure of the A.2 node's DP-SGD (record level), beside a non-DP control.

The canaries of :mod:`nimmer_train.privacy.exposure` are planted 1, 4 and 16 times among the
pool's training lines; the A.2 node's own training (:func:`train_locally` with its public Poisson
rate) then runs for ``rounds`` rounds, each starting from the adapter the previous one returned
(the node's record-level mechanism over a federation, without the other contributors' updates or
the server's noise to hide behind: the worst case for memorisation). The control trains on the
same planted lines with the same recipe and no noise (epsilon infinite); it must show clearly
higher exposure than the DP run, or the canaries lack power.

:func:`federation_exposure` is what the federate stage publishes beside the user-level audit: the
A.2 node's recipe from the federation's settings, for the released rounds, on public stand-in
lines shaped like the pool's (the audit's own training is not accounted, so it never reads the
pool).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.local_training import LocalTrainingConfig, load_trainable, train_locally
from nimmer_train.federation.wire import get_arrays, set_arrays
from nimmer_train.privacy.dp_fedavg import entropy_rng
from nimmer_train.privacy.exposure import (
    CHANCE_BITS,
    PLANTINGS,
    ExposureReport,
    canary_exposures,
    make_canaries,
    plant,
)
from nimmer_train.privacy.exposure import references as candidates_for


def train_rounds(
    base_dir: Path,
    adapter_dir: Path,
    texts: list[str],
    settings: LocalTrainingConfig,
    rounds: int,
    accountant: Path,
    delta: float,
) -> tuple[list[np.ndarray], float | None]:
    """``rounds`` local trainings chained through their adapters: (final arrays, epsilon so far)."""
    model, _ = load_trainable(base_dir, adapter_dir)
    arrays = get_arrays(model)
    eps: float | None = None
    for r in range(rounds):
        result = train_locally(
            base_dir, adapter_dir, arrays, texts, dataclasses.replace(settings, seed=settings.seed + r),
            accountant, delta,
        )  # fmt: skip
        arrays, eps = result.arrays, result.epsilon
    return arrays, eps


def canary_exposure(
    base_dir: Path,
    adapter_dir: Path,
    texts: Sequence[str],
    settings: LocalTrainingConfig,
    rounds: int = 1,
    delta: float = 1e-5,
    per_count: int = 4,
    references: int = 10_000,
    plantings: Sequence[int] = PLANTINGS,
    control: LocalTrainingConfig | None = None,
    rng: np.random.Generator | None = None,
) -> ExposureReport:
    """Plant ``per_count`` canaries per planting count among ``texts`` (the pool's training lines),
    train the adapter at ``adapter_dir`` with ``settings`` (DP) and with ``control`` (default: the
    same recipe without noise) for ``rounds`` rounds each, and return every canary's exposure
    among ``references`` candidates under both. ``rng`` draws the secrets, the planting order and
    the references (default: the OS's entropy); the DP noise always comes from the OS's entropy."""
    if settings.dp.noise_multiplier <= 0:
        raise ValueError("canary_exposure: settings is the DP run; give it dp.noise_multiplier > 0")
    rng = rng if rng is not None else entropy_rng()
    control = control or without_noise(settings)
    canaries = make_canaries(per_count, rng, plantings)
    planted = plant(texts, canaries, rng)
    candidates = [candidates_for(c, references, rng) for c in canaries]  # the same for both runs
    exposures: dict[str, list[float]] = {}
    eps: dict[str, float | None] = {}
    with tempfile.TemporaryDirectory(prefix="nimmer-exposure-") as work:
        for name, recipe in (("dp", settings), ("control", control)):
            arrays, eps[name] = train_rounds(
                base_dir, adapter_dir, planted, recipe, rounds, Path(work) / f"{name}.json", delta
            )
            model, tokenizer = load_trainable(base_dir, adapter_dir)
            set_arrays(model, arrays)
            exposures[name] = canary_exposures(model, tokenizer, canaries, candidates)
    # the planted lines' count is not recorded: it would publish the pool's exact size
    recipe = {f"dp_{k}": v for k, v in published_recipe(settings).items()}
    recipe.update({f"control_{k}": v for k, v in published_recipe(control).items()})
    return ExposureReport(
        plantings=tuple(c.plantings for c in canaries),
        dp=tuple(exposures["dp"]),
        control=tuple(exposures["control"]),
        references=references,
        dp_epsilon=eps["dp"],
        delta=delta,
        settings={"rounds": rounds, **recipe},
    )


POWER_BITS = 1.0  # the control must pass both the DP run and chance by this much to have power
WORST_CASE_PLANTINGS = 4  # issue 14's bound is on canaries planted up to 4 times


def a2_recipe(settings: FederatedConfig) -> LocalTrainingConfig:
    """The A.2 node's local-training recipe as the server's fit config hands it over
    (:meth:`nimmer_train.federation.client.Contributor.fit`, round 1): DP-SGD at the public rate."""
    return LocalTrainingConfig(settings.local, settings.local_dp, seed=settings.seed + 1, public_rate=True)


def without_noise(settings: LocalTrainingConfig, steps: int = 0) -> LocalTrainingConfig:
    """The audit's control: the same recipe with DP-SGD's noise off (``steps``: its local steps
    per round instead of the recipe's, 0: the same)."""
    return dataclasses.replace(
        settings,
        recipe=dataclasses.replace(settings.recipe, steps=steps or settings.recipe.steps),
        dp=dataclasses.replace(settings.dp, noise_multiplier=0.0),
    )


def published_recipe(settings: LocalTrainingConfig) -> dict[str, object]:
    """A recipe as the exposure report has always published it: the flat names the local
    training settings had before the config groups (issue 41), so reports stay comparable."""
    recipe, dp = settings.recipe, settings.dp
    return {
        "local_steps": recipe.steps,
        "batch_size": recipe.batch_size,
        "lr": recipe.lr,
        "max_length": recipe.max_length,
        "max_examples": recipe.max_examples,
        "dp_noise_multiplier": dp.noise_multiplier,
        "dp_max_grad_norm": dp.max_grad_norm,
        "grad_sample_mode": dp.grad_sample_mode,
        "seed": settings.seed,
        "public_rate": settings.public_rate,
        "private": settings.private,
    }


def federation_exposure(
    base_dir: Path,
    adapter_dir: Path,
    pool: Path,
    settings: FederatedConfig,
    released_rounds: int,
    a2_runs: int,
) -> dict[str, object] | None:
    """The record-level audit of a federation, for its privacy report: canary exposure of the A.2
    node's DP-SGD (its recipe, from the start adapter, over the ``released_rounds`` rounds as if
    the node trained in every one of them: the worst case) and of the control (the same lines and
    recipe without noise, ``audit.control_steps`` steps per round). Both train on public
    stand-in lines shaped like the pool's (the public held-out generator, ``local.max_examples`` of
    them), never on the pool: the audit's own training runs are not in the ledger, so they may
    not touch anyone's data (the figure measures the mechanism, which is what it reports). None
    without privacy, without released rounds, or with ``audit.canaries`` 0. ``pool`` is
    unused; it stays in the signature for the callers."""
    from nimmer_train.federation.client import example_text
    from nimmer_train.memory.synthetic import heldout_examples

    s = settings
    if s.no_privacy or s.audit.canaries < 1 or released_rounds < 1:
        return None
    started = time.monotonic()
    dp = a2_recipe(s)
    control = without_noise(dp, s.audit.control_steps)
    report = canary_exposure(
        base_dir, adapter_dir, [example_text(e) for e in heldout_examples(s.local.max_examples, seed=20_000)],
        dp, released_rounds, s.delta,
        s.audit.canaries, s.audit.references, control=control,
    )  # fmt: skip
    return exposure_record(report, released_rounds, a2_runs, control.recipe.steps, time.monotonic() - started)


def exposure_record(
    report: ExposureReport, rounds: int, a2_runs: int, control_steps: int, seconds: float
) -> dict[str, object]:
    """An exposure report as the privacy report publishes it: the means the card quotes first,
    whether the control had power, then every figure of :meth:`ExposureReport.record`."""
    dp_worst = report.mean("dp", up_to=WORST_CASE_PLANTINGS)
    control_all, dp_all = report.mean("control"), report.mean("dp")
    return {
        "dp_mean_exposure_up_to_4x": dp_worst,
        "control_mean_exposure_up_to_4x": report.mean("control", up_to=WORST_CASE_PLANTINGS),
        "dp_mean_exposure": dp_all,
        "control_mean_exposure": control_all,
        "control_has_power": control_all >= max(dp_all, CHANCE_BITS) + POWER_BITS,
        "control": f"the same stand-in lines and recipe without noise, {control_steps} steps per round",
        "a2_runs_released": a2_runs,
        "seconds": seconds,
        **report.record(),
        "rounds": rounds,
    }
