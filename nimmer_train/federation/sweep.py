"""The privacy-utility table: epsilon x N cells of the federation's mechanism, in the simulator.

Every cell runs DP-FedAvg exactly as the Flower path does (:mod:`nimmer_train.federation.simulator`)
on a population of N contributors (N - 1 seeded A.1 players and the A.2 node, as the stage builds
them), with the same rounds T and the same expected cohort q N for every N; the noise multiplier
z is calibrated so that the T rounds spend exactly the cell's epsilon at delta (Opacus RDP,
:func:`noise_multiplier_for`); epsilon inf is the non-private run (z = 0) on the same N, q and T.

Each cell runs ``seeds`` times. Seed k of every cell of one N draws its cohorts and noise from
the same generator ``(seed, N, k)``, so the cells of a row see the same cohorts (paired
comparisons); the population and the held-out set stay the same across seeds. Utility is the
held-out loss gain (loss before - after).

Noise alone can lower the held-out loss of a small, near-chance model (issue 43: 3 of 3 draws),
so a private cell's gain is not all learning. Each private run therefore has a noise-only arm:
the very noise vectors the run released (its generator replayed, :func:`noise_only_gain`) added to
the unchanged start adapter, a zero update. A run's ``share`` is the gain its contributors added
beyond what that noise alone gave, over the non-private gain of the same N and seed:
``(gain - max(noise-only gain, 0)) / non-private gain``. A noise that helps is not credited to
the contributors; a noise that hurts is not subtracted (the published model carries the harm, so
the raw share stands: crediting the recovery, as ``(gain - noise) / (non-private - noise)`` would,
lets a cell whose noise wrecks the adapter pass). ``share_raw`` is the plain gain over the
non-private gain. A cell reports the mean share over its seeds with the spread (sd, min and
max). The goals are judged on the mean, and every ``control_cells`` cell (an epsilon so small that
the noise swamps the update) must fall below the goal: a table that cannot show a failure shows
nothing (:func:`controls_failed`).

Resumable per (cell, seed): each run writes ``result.json`` when done (a rerun skips it) and
checkpoints every round (a killed run resumes after its last released round, never spending a
round twice).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import FederatedConfig, PrivacySweepConfig
from nimmer_train.federation.budget import mechanism_of
from nimmer_train.federation.population import build_population
from nimmer_train.federation.simulator import SimulationState, Simulator
from nimmer_train.memory.embedding import Embedder
from nimmer_train.privacy.dp_fedavg import noise_multiplier_for, poisson_cohort, release_arrays

RESULT = "result.json"
TABLE = "privacy_utility.md"
PLOT = "privacy_utility.png"
Log = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Cell:
    epsilon: float  # inf: no noise
    population: int

    @property
    def name(self) -> str:
        eps = "inf" if math.isinf(self.epsilon) else f"{self.epsilon:g}"
        return f"eps{eps}-N{self.population}"


def cell_settings(base: FederatedConfig, sweep: PrivacySweepConfig, cell: Cell) -> FederatedConfig:
    """The federation of one cell: the base recipe with N, q = cohort / N, z for epsilon, T, delta."""
    rate = sweep.cohort / cell.population
    private = not math.isinf(cell.epsilon)
    z = noise_multiplier_for(cell.epsilon, rate, sweep.rounds, sweep.delta) if private else 0.0
    return dataclasses.replace(
        base,
        rounds=sweep.rounds,
        delta=sweep.delta,
        epsilon_budget=None,
        no_privacy=not private,
        min_participants=1,
        user_dp=dataclasses.replace(base.user_dp, population_size=0, fraction_fit=rate, noise_multiplier=z),
        local_dp=dataclasses.replace(base.local_dp, on_devices=False),
        # the simulator sums in the clear: SecAgg+ sums the same values
        secagg=dataclasses.replace(base.secagg, enabled=False),
        simulation=dataclasses.replace(
            base.simulation,
            contributors=cell.population - 1,  # + the A.2 node: N nodes
            population=["A1_federated"],
            faults=[],
        ),
    )


def run_cell(
    simulator: Simulator,
    settings: FederatedConfig,
    cell: Cell,
    root: Path,
    sweep: PrivacySweepConfig,
    seed: int = 0,
) -> dict[str, Any]:
    """One run of a cell, seed ``seed`` (read from ``result.json`` when the run is done)."""
    work = root / cell.name / f"seed{seed}"
    done = work / RESULT
    if done.exists():
        return json.loads(done.read_text())
    started = time.monotonic()
    state = simulator.run(settings, work, cell_rng(sweep, cell, seed), evaluate_every=sweep.evaluate_every)
    noise_only = noise_only_gain(simulator, settings, state, cell_rng(sweep, cell, seed))
    released = [r for r in state.records if r.get("accepted")]
    after = state.records[-1]["heldout_loss"]
    row = {
        "epsilon": None if math.isinf(cell.epsilon) else cell.epsilon,
        "population": cell.population,
        "seed": seed,
        "sample_rate": settings.user_dp.fraction_fit,
        "expected_cohort": settings.user_dp.fraction_fit * settings.nodes(),
        "noise_multiplier": settings.user_dp.noise_multiplier,
        "noise_std_over_clip": settings.user_dp.noise_multiplier
        / (settings.user_dp.fraction_fit * settings.nodes()),
        "rounds": settings.rounds,
        "released": len(released),
        "delta": settings.delta,
        "epsilon_spent": released[-1].get("epsilon_a1_user_level") if released else 0.0,
        "mean_cohort": float(np.mean([r["sampled"] for r in state.records])),
        "heldout_loss_before": state.initial_loss,
        "heldout_loss_after": after,
        "gain": state.initial_loss - after,
        "noise_only_gain": noise_only,
        "curve": [(r["round"], r["heldout_loss"]) for r in state.records if "heldout_loss" in r],
        "seconds": state.seconds
        if time.monotonic() - started > state.seconds
        else time.monotonic() - started,
        "built_devices": len(simulator.population.built()),
    }
    write_json_atomic(done, row)
    return row


def cell_rng(sweep: PrivacySweepConfig, cell: Cell, seed: int) -> np.random.Generator:
    """The generator of seed ``seed`` of every cell of one N: the row's cells share cohorts."""
    return np.random.default_rng([sweep.seed, cell.population, seed])


def noise_only_arrays(
    simulator: Simulator, settings: FederatedConfig, state: SimulationState, rng: np.random.Generator
) -> list[np.ndarray]:
    """The start adapter plus the noise the run ``state`` released, and nothing else: ``rng`` (a
    fresh copy of the run's generator) replayed as the simulator draws from it (each round's
    cohort, then a released round's noise over the update and the A.1 indicator), each released
    round's noise / (q N) added to a zero update."""
    mechanism = mechanism_of(settings)
    arrays = [a.copy() for a in simulator.start]
    zeros = [np.zeros(a.shape, np.float64) for a in arrays] + [np.zeros(1)]
    for record in state.records:
        if "sampled" not in record:  # a round killed before adoption drew nothing here
            continue
        poisson_cohort(mechanism.population, mechanism.sample_rate, rng)
        if record.get("accepted"):
            *noise, _ = release_arrays(zeros, mechanism, rng)
            arrays = [a + n.astype(np.float32) for a, n in zip(arrays, noise, strict=True)]
    return arrays


def noise_only_gain(
    simulator: Simulator, settings: FederatedConfig, state: SimulationState, rng: np.random.Generator
) -> float:
    """The held-out loss gain of the run's noise alone (:func:`noise_only_arrays`); 0 without noise."""
    if settings.user_dp.noise_multiplier == 0:
        return 0.0
    assert state.initial_loss is not None  # the run evaluated its start
    return state.initial_loss - simulator.evaluate(noise_only_arrays(simulator, settings, state, rng))


def _row_cells(sweep: PrivacySweepConfig, n: int) -> list[Cell]:
    """The cells of population ``n``: the epsilons, its control cells, the non-private reference."""
    epsilons = list(sweep.epsilons)
    for spec in sweep.control_cells:
        eps, at = spec.split("@")
        if int(at) == n and float(eps) not in epsilons:
            epsilons.append(float(eps))
    cells = [Cell(e, n) for e in epsilons]
    if not any(math.isinf(c.epsilon) for c in cells):
        cells.append(Cell(float("inf"), n))  # the reference of the row's shares
    return cells


def run_sweep(
    base_dir: Path,
    adapter_dir: Path,
    base: FederatedConfig,
    sweep: PrivacySweepConfig,
    root: Path,
    embedder: Embedder,
    log: Log | None = None,
) -> list[dict[str, Any]]:
    """Every cell ``sweep.seeds`` times, row by row (one population per N, shared by its
    epsilons and seeds, seed by seed so that a row's shares come early); one summary per cell
    (:func:`summarise`)."""
    runs: list[dict[str, Any]] = []
    simulator: Simulator | None = None
    for n in sweep.populations:
        cells = _row_cells(sweep, n)
        first = cell_settings(base, sweep, cells[0])
        population = build_population(root / f"population-N{n}", first, embedder)
        if simulator is None:
            simulator = Simulator.load(base_dir, adapter_dir, population, first)
        simulator = dataclasses.replace(simulator, population=population)
        for seed in range(sweep.seeds):
            for cell in cells:
                run = run_cell(simulator, cell_settings(base, sweep, cell), cell, root, sweep, seed)
                runs.append(run)
                if log:
                    log(run)
    return summarise(runs)


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell (in the runs' first order): the mechanism, the mean held-out losses, gain
    and noise-only gain, and the share of the non-private gain net of the noise-only gain (each
    run's against the non-private run of the same N and seed, :func:`net_share`; None where that
    gain is not positive): ``share`` the mean over the ``share_seeds`` seeds that have one,
    ``share_sd`` (sample sd; 0 for one seed), ``share_min``, ``share_max``, ``share_raw`` (the
    mean of gain / non-private gain); the runs themselves under ``runs``."""
    reference = {(r["population"], r["seed"]): r["gain"] for r in runs if r["epsilon"] is None}
    cells: dict[tuple[float | None, int], list[dict[str, Any]]] = {}
    for r in runs:
        ref = reference.get((r["population"], r["seed"]))
        share, raw = (net_share(r, ref), r["gain"] / ref) if ref and ref > 0 else (None, None)
        cells.setdefault((r["epsilon"], r["population"]), []).append({**r, "share": share, "share_raw": raw})
    rows = []
    for group in cells.values():
        shares = [r["share"] for r in group if r["share"] is not None]
        raws = [r["share_raw"] for r in group if r["share_raw"] is not None]
        gains = [r["gain"] for r in group]
        noise_only = [r["noise_only_gain"] for r in group if r.get("noise_only_gain") is not None]
        mechanism = {k: group[0][k] for k in MECHANISM}
        spent = [r["epsilon_spent"] for r in group if r["epsilon_spent"] is not None]
        mechanism["epsilon_spent"] = max(spent) if spent else None  # a seed may release fewer rounds
        rows.append(
            {
                **mechanism,
                "seeds": len(group),
                "heldout_loss_before": float(np.mean([r["heldout_loss_before"] for r in group])),
                "heldout_loss_after": float(np.mean([r["heldout_loss_after"] for r in group])),
                "gain": float(np.mean(gains)),
                "gain_sd": _sd(gains),
                "noise_only_gain": float(np.mean(noise_only)) if noise_only else None,
                "share_raw": float(np.mean(raws)) if raws else None,
                "share_seeds": len(shares),  # the seeds the share is taken over
                "share": float(np.mean(shares)) if shares else None,
                "share_sd": _sd(shares) if shares else None,
                "share_min": min(shares) if shares else None,
                "share_max": max(shares) if shares else None,
                "seconds": sum(r["seconds"] for r in group),
                "runs": group,
            }
        )
    return rows


MECHANISM = (
    "epsilon",
    "population",
    "sample_rate",
    "expected_cohort",
    "noise_multiplier",
    "noise_std_over_clip",
    "rounds",
    "delta",
)


def net_share(run: dict[str, Any], reference_gain: float) -> float:
    """The run's gain beyond what its noise alone gave (a noise that helped is not the
    contributors'; one that hurt stays in), over the non-private gain. A run without a noise-only
    arm (a result written before it) counts its whole gain."""
    noise = run.get("noise_only_gain") or 0.0
    return (run["gain"] - max(noise, 0.0)) / reference_gain


def _sd(values: list[float]) -> float:
    return float(np.std(values, ddof=1)) if len(values) > 1 else 0.0


def goal_met(rows: list[dict[str, Any]], sweep: PrivacySweepConfig) -> dict[str, bool | None]:
    """Each goal cell ("8@10000"): its mean share >= goal_share (None when the cell was not run)."""
    out: dict[str, bool | None] = {}
    for spec in sweep.goal_cells:
        eps, n = spec.split("@")
        row = next((r for r in rows if r["epsilon"] == float(eps) and r["population"] == int(n)), None)
        out[spec] = None if row is None or row["share"] is None else row["share"] >= sweep.goal_share
    return out


def controls_failed(rows: list[dict[str, Any]], sweep: PrivacySweepConfig) -> dict[str, bool | None]:
    """Each control cell: True when its mean share fell below goal_share, as it must (False: the
    table could not show a failure; None: not run, or no share)."""
    out: dict[str, bool | None] = {}
    for spec, met in goal_met(rows, dataclasses.replace(sweep, goal_cells=list(sweep.control_cells))).items():
        out[spec] = None if met is None else not met
    return out


def table(rows: list[dict[str, Any]], sweep: PrivacySweepConfig) -> str:
    """The privacy-utility table as Markdown: one line per cell (means over its seeds, the share's
    sd and range over the seeds that have one), goals and controls marked on the mean; a cell says
    how many seeds its share is the mean of, and how many had none (their non-private gain was <= 0)."""
    lines = [
        f"| epsilon (delta={sweep.delta:g}) | N | q | z | z/(qN) | held-out loss before -> after (mean) | "
        "gain (mean ± sd) | noise-only gain (mean) | share of non-private gain, net of the noise-only "
        "gain: mean ± sd [min, max] | seeds | seconds |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        eps = "inf (no DP)" if r["epsilon"] is None else f"{r['epsilon']:g}"
        seeds = r["seeds"]
        taken = r.get("share_seeds", seeds)
        dropped = seeds - taken
        without = f"{dropped} seed{_s(dropped)} without a share (non-private gain <= 0)"
        share = "—" + (f" ({without})" if dropped else "")
        if r["share"] is not None:
            share = (
                f"{100 * r['share']:.1f} % ± {100 * r['share_sd']:.1f} "
                f"[{100 * r['share_min']:.1f}, {100 * r['share_max']:.1f}]"
            )
            notes = _verdicts(r, sweep)
            if notes or dropped:
                notes.append(f"mean of {taken} seed{_s(taken)}")
            if dropped:
                notes.append(without)
            if notes:
                share += f" ({', '.join(notes)})"
        lines.append(
            f"| {eps} | {r['population']:,} | {r['sample_rate']:.2g} | {r['noise_multiplier']:.3f} | "
            f"{r['noise_std_over_clip']:.2e} | "
            f"{r['heldout_loss_before']:.4f} -> {r['heldout_loss_after']:.4f} | "
            f"{r['gain']:.4f} ± {r['gain_sd']:.4f} | {_figure(r.get('noise_only_gain'))} | {share} | "
            f"{seeds} | {r['seconds']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def _verdicts(row: dict[str, Any], sweep: PrivacySweepConfig) -> list[str]:
    """A goal cell's verdict and a control cell's (it must fall below the goal) on the mean share."""
    if row["epsilon"] is None:
        return []
    cell = f"{row['epsilon']:g}@{row['population']}"
    spec = {f"{float(e):g}@{n}" for e, n in (g.split("@") for g in sweep.goal_cells)}
    controls = {f"{float(e):g}@{n}" for e, n in (g.split("@") for g in sweep.control_cells)}
    goal, met = f"{100 * sweep.goal_share:.0f} %", row["share"] >= sweep.goal_share
    notes = []
    if cell in spec:
        notes.append("goal met" if met else f"goal {goal} NOT met")
    if cell in controls:
        notes.append(
            f"control: below {goal}, as it must be"
            if not met
            else f"CONTROL NOT BELOW {goal}: this table cannot show a failure"
        )
    return notes


def _figure(value: float | None) -> str:
    return "—" if value is None else f"{value:.4f}"


def _s(count: int) -> str:
    return "" if count == 1 else "s"


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Mean share of the non-private gain against epsilon, one line per N, the seeds' range as
    error bars (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for n in sorted({r["population"] for r in rows}):
        points = sorted(
            (r["epsilon"], 100 * r["share"], 100 * r["share_min"], 100 * r["share_max"])
            for r in rows
            if r["population"] == n and r["epsilon"] is not None and r["share"] is not None
        )
        if points:
            eps, mean, low, high = (list(column) for column in zip(*points, strict=True))
            below = [m - lo for m, lo in zip(mean, low, strict=True)]
            above = [hi - m for m, hi in zip(mean, high, strict=True)]
            ax.errorbar(eps, mean, yerr=[below, above], marker="o", capsize=3, label=f"N = {n:,}")
    ax.axhline(90, color="grey", linestyle="--", linewidth=1, label="goal: 90 %")
    ax.set_xscale("log")
    ticks = sorted({r["epsilon"] for r in rows if r["epsilon"] is not None})
    ax.set_xticks(ticks, [f"{e:g}" for e in ticks])
    ax.minorticks_off()
    ax.set_xlabel("user-level epsilon (delta = 1e-6)")
    seeds = max((r["seeds"] for r in rows), default=1)
    ax.set_ylabel("% of the non-private held-out loss gain")
    ax.set_title(f"DP-FedAvg: privacy-utility (same N, q, T; mean, range of {seeds} seeds)")
    ax.legend()
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)


def content_identity(folder: Path) -> dict[str, str]:
    """What a published folder holds: each file's sha256, from its manifest. Not the manifest's
    fingerprint, which names how the folder was made (two bases made alike, or a base and its
    retrained copy, can share it and differ in their weights)."""
    from nimmer_train.artifacts import read_manifest

    return {row["path"]: row["sha256"] for row in read_manifest(folder)["files"]}


def sweep_fingerprint(cfg: Any, base_dir: Path, adapter_dir: Path) -> str:
    """The output folder's fingerprint: the base's and the start adapter's content
    (:func:`content_identity`), the federated recipe and the sweep's cells. It leaves out what
    does not change a run's result: ``seeds`` and ``control_cells`` (more seeds or cells extend a
    sweep: its finished (cell, seed) runs stay where they are), ``goal_share`` and ``goal_cells``
    (how the table judges)."""
    from nimmer_train.artifacts import fingerprint

    return fingerprint(
        {
            # 3: the base and adapter by content; the held-out set in its own seed namespace;
            # 4: each private run's noise-only arm (a result.json of 3 has none)
            "version": 4,
            "base": content_identity(base_dir),
            "adapter": content_identity(adapter_dir),
            "federated": dataclasses.asdict(cfg.federated),
            "sweep": {
                k: v
                for k, v in dataclasses.asdict(cfg.privacy_sweep).items()
                if k not in ("goal_cells", "goal_share", "seeds", "control_cells")
            },
        }
    )


def resumable_run(cfg: Any, run_id: str | None) -> str | None:
    """The MLflow run a rerun continues: the one a killed sweep of this same config left behind.
    MLflow keeps a param's first value, so a rerun that changes what the folder's fingerprint
    leaves out (more seeds, another goal, another path to the same base) starts a new run in the
    same folder instead, whose params say what it ran with (None: start one)."""
    if run_id is None or not cfg.tracking.enabled:
        return run_id
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    from nimmer_train import tracking

    tracking.configure(cfg.tracking)
    try:
        logged = MlflowClient().get_run(run_id).data.params
    except MlflowException:
        return None
    wanted = {k: v[:6000] for k, v in tracking.flatten(dataclasses.asdict(cfg)).items()}  # as logged
    return run_id if all(logged.get(k) == v for k, v in wanted.items()) else None


def sweep_inputs(cfg: Any) -> tuple[Path, Path, str]:
    """(base, start adapter, register): the federate stage's (:func:`~nimmer_train.federation.stage.locate`;
    with ``federated.start_rank`` > 0 a fresh small LoRA on the configured base)."""
    from nimmer_train.federation.stage import locate

    return locate(cfg, None)


def sweep_stage(cfg: Any, pipeline: str = "privacy_sweep") -> list[dict[str, Any]]:
    """The sweep of ``cfg.privacy_sweep`` on the base and adapter the federate stage would use,
    tracked in MLflow (each run's gain, z and seconds, each cell's mean share and its sd, the
    table, its JSON and the plot as artifacts); outputs under
    ``<workdir>/privacy_sweep/<fingerprint>/`` (:func:`sweep_fingerprint`: a rerun with more
    seeds adds runs beside the finished ones; another base or adapter gets its own folder). A
    rerun of the same config continues its MLflow run; one with other seeds or goals starts a new
    run (:func:`resumable_run`); ``privacy_utility.json`` records the seeds and goals its table was
    judged with."""
    import mlflow

    from nimmer_train import tracking
    from nimmer_train.federation.population import SketchEmbedder

    base_dir, adapter_dir, register = sweep_inputs(cfg)
    fp = sweep_fingerprint(cfg, base_dir, adapter_dir)
    root = Path(cfg.paths.workdir).resolve() / "privacy_sweep" / fp[:12]
    root.mkdir(parents=True, exist_ok=True)
    run_file = root / "mlflow_run_id"
    earlier = run_file.read_text().strip() if run_file.exists() else None
    resume = resumable_run(cfg, earlier)
    sweep = cfg.privacy_sweep
    with tracking.stage_run(cfg, pipeline, "privacy_sweep", resume_run_id=resume) as run_id:
        if run_id:
            run_file.write_text(run_id)
            mlflow.set_tags({"register": register, "start_adapter": str(adapter_dir)})
            if earlier and earlier != run_id:  # the same folder's runs, another seed count or goal
                mlflow.set_tag("privacy_sweep.extends_run", earlier)

        def log(row: dict[str, Any]) -> None:
            eps = "inf" if row["epsilon"] is None else f"{row['epsilon']:g}"
            print(
                f"cell epsilon={eps} N={row['population']} seed {row['seed']}: "
                f"z={row['noise_multiplier']:.3f}, held-out loss {row['heldout_loss_before']:.4f} -> "
                f"{row['heldout_loss_after']:.4f} ({row['seconds']:.0f} s)",
                flush=True,
            )
            if run_id:
                mlflow.log_metrics(
                    {
                        f"{k}_eps{eps}_N{row['population']}_seed{row['seed']}": float(row[k])
                        for k in ("gain", "noise_only_gain", "seconds", "noise_multiplier")
                    }
                )

        rows = run_sweep(base_dir, adapter_dir, cfg.federated, sweep, root, SketchEmbedder(), log)
        goals, controls = goal_met(rows, sweep), controls_failed(rows, sweep)
        judged = {
            "seeds": sweep.seeds,
            "goal_share": sweep.goal_share,
            "goal_cells": list(sweep.goal_cells),
            "control_cells": list(sweep.control_cells),
        }
        summary = {"rows": rows, "goals": goals, "controls_below_goal": controls, **judged}
        write_json_atomic(root / "privacy_utility.json", summary)
        (root / TABLE).write_text(table(rows, sweep))
        plot(rows, root / PLOT)
        if run_id:
            for r in rows:
                if r["share"] is not None and r["epsilon"] is not None:
                    name = f"eps{r['epsilon']:g}_N{r['population']}"
                    mlflow.log_metrics({f"share_{name}": r["share"], f"share_sd_{name}": r["share_sd"]})
            for name in (TABLE, PLOT, "privacy_utility.json"):
                mlflow.log_artifact(str(root / name), "privacy_sweep")
    print(table(rows, sweep))
    print(
        f"goals (mean share over the seeds whose non-private gain is positive, of {sweep.seeds}, "
        f">= {100 * sweep.goal_share:.0f} %): {goals}; controls below it, as they must be: {controls}"
    )
    print(f"outputs: {root}")
    return rows
