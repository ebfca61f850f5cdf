"""The federate stage: the Flower app on Flower's simulation engine, with virtual contributors
built from synthetic players, logged to MLflow.

Layout under ``<workdir>/federation/<fp>/``: ``devices/`` (the simulated players' devices:
device-side, the only place their ids exist) and ``server/`` (the A.2 intake pool, the round
checkpoint, the MLflow run id). The aggregated adapter is published to
``artifacts/federated/<base>/<register>-<fp>/``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow

from nimmer_train import tracking
from nimmer_train.artifacts import (
    MANIFEST,
    base_path,
    federated_path,
    fingerprint,
    intact_manifest,
    read_manifest,
    sha256_file,
    source_fingerprint,
)
from nimmer_train.base.build import plan
from nimmer_train.config import Config
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.corpus.ingest import find_corpus
from nimmer_train.errors import NimmerError
from nimmer_train.federation import (
    budget,
    checkpoint,
    client,
    exposure_audit,
    local_training,
    mods,
    results,
    rounds,
    strategy,
    wire,
)
from nimmer_train.federation.app import client_app, server_app
from nimmer_train.federation.checkpoint import ServerState, ledger_of
from nimmer_train.federation.client import Node
from nimmer_train.federation.population import SketchEmbedder, build_population, deliver_uploads
from nimmer_train.federation.rounds import ServerSetup
from nimmer_train.federation.start import fresh_start_adapter
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.loras.stage import LoraResult, configured_adapters
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.synth.synthesize import find_synth

log = logging.getLogger(__name__)
FED_VERSION = 1
A2_POOL = "a2_pool.sqlite"  # under the federation's server/ folder


@dataclass(frozen=True)
class FederationResult:
    adapter: Path
    metadata: dict[str, Any]
    records: list[dict[str, Any]]
    folder: Path  # devices/ and server/ of this federation


def locate(cfg: Config, loras: LoraResult | None) -> tuple[Path, Path, str]:
    """(base dir, start adapter dir, register) for this federation."""
    s = cfg.federated
    if s.start_rank and not s.adapter_dir:
        register = s.register or (cfg.lora.registers or cfg.registers.names)[0]
        base = _start_base(cfg, loras, register)
        root = cfg.paths.artifacts_dir() / "federated" / base.name
        return base, fresh_start_adapter(base, s, register, root), register
    if s.adapter_dir:
        adapter = Path(s.adapter_dir)
    elif loras is not None and loras.adapters:
        register = s.register or next(iter(loras.adapters))
        if register not in loras.adapters:
            raise NimmerError(
                f"federated.register={register!r} has no trained adapter; "
                f"trained: {', '.join(loras.adapters)}"
            )
        adapter = loras.adapters[register]
    else:
        adapter = _find_adapter(cfg)
    meta = read_metadata(adapter)
    base = (
        Path(cfg.lora.base_dir)
        if cfg.lora.base_dir
        else base_path(cfg.paths.artifacts_dir(), meta["base"]["label"])
    )
    if not (base / MANIFEST).exists():
        raise NimmerError(f"adapter {adapter} names base {meta['base']['label']}, which is not at {base}")
    return base, adapter, meta["register"]


def _start_base(cfg: Config, loras: LoraResult | None, register: str) -> Path:
    """The base a fresh start adapter goes on: the one the register LoRAs were trained on, else
    ``lora.base_dir``, else the base this config builds (its inputs found, never built)."""
    if cfg.lora.base_dir:
        base = Path(cfg.lora.base_dir)
    elif loras is not None and register in loras.adapters:
        label = read_metadata(loras.adapters[register])["base"]["label"]
        base = base_path(cfg.paths.artifacts_dir(), label)
    else:
        artifacts = cfg.paths.artifacts_dir()
        synth = find_synth(cfg.composition, cfg.registers, cfg.teacher, cfg.curation, artifacts)
        base = plan(cfg, find_corpus(cfg.corpus, artifacts), synth).out
    if not (base / MANIFEST).exists():
        raise NimmerError(
            f"no published base at {base}: run `python -m pipelines.build_base` with the same "
            "overrides first, or point lora.base_dir at a base folder"
        )
    return base


def _find_adapter(cfg: Config) -> Path:
    """The adapter this config's LoRA settings train for the federated register (its
    fingerprint), never whichever one on disk is newest."""
    register = cfg.federated.register or (cfg.lora.registers or cfg.registers.names)[0]
    adapter = configured_adapters(cfg).get(register)
    if adapter is None or not intact_manifest(adapter):
        raise NimmerError(
            f"no trained adapter for register {register!r} at {adapter or 'lora.registers'}: run "
            "`python -m pipelines.train_loras` with the same overrides first, or set federated.adapter_dir"
        )
    return adapter


@dataclass(frozen=True)
class FederationPlan:
    base_dir: Path
    adapter_dir: Path  # the adapter the federation starts from
    register: str
    fingerprint: str
    out: Path  # the published federated adapter
    folder: Path  # devices/ and server/ of this federation

    @property
    def state_file(self) -> Path:
        return self.folder / "server" / "rounds" / checkpoint.STATE_FILE


def plan_federation(cfg: Config, loras: LoraResult | None = None) -> FederationPlan:
    """Where this config's federation starts from and where its results go."""
    base_dir, adapter_dir, register = locate(cfg, loras)
    settings = dataclasses.asdict(cfg.federated)
    for key in ("enabled", "register", "adapter_dir"):
        settings.pop(key)
    fp = fingerprint(
        {
            "version": FED_VERSION,
            "code": source_fingerprint(
                budget,
                checkpoint,
                client,
                exposure_audit,
                local_training,
                mods,
                results,
                rounds,
                strategy,
                wire,
                sys.modules[__name__],
            ),
            "adapter": read_manifest(adapter_dir)["fingerprint"],
            "settings": settings,
        }
    )
    out = federated_path(cfg.paths.artifacts_dir(), base_dir.name, register, fp)
    folder = Path(cfg.paths.workdir).resolve() / "federation" / fp[:12]
    return FederationPlan(base_dir, adapter_dir, register, fp, out, folder)


def federate_stage(
    cfg: Config, loras: LoraResult | None = None, pipeline: str = "federate"
) -> FederationResult:
    p = plan_federation(cfg, loras)
    if intact_manifest(p.out):
        print(f"federated adapter: {p.out} (up to date)")
        meta = read_metadata(p.out)
        return FederationResult(p.out, meta, _records(p.out), p.folder)
    budget.require_budget(cfg.federated, _ledger_of(p, cfg.federated), _state_of(p), True)  # before any work
    run_file = p.folder / "server" / "mlflow_run_id"
    resume = run_file.read_text().strip() if run_file.exists() else None
    with tracking.stage_run(cfg, pipeline, "federate", resume_run_id=resume) as run_id:
        if run_id:
            run_file.parent.mkdir(parents=True, exist_ok=True)
            run_file.write_text(run_id)
            mlflow.set_tags(
                {
                    "register": p.register,
                    "start_adapter": str(p.adapter_dir),
                    "federation": p.fingerprint[:12],
                }
            )
            _log_start(p)
        logger = tracking.metric_logger(run_id, cfg.tracking.tracking_uri() if run_id else None)
        started = time.monotonic()
        published = run_federation(p, cfg.federated, lambda r: logger(_round_metrics(r), int(r["round"])))
        if run_id:
            _log_federation(published["federation"], p.out, time.monotonic() - started)
            _log_pool(p.folder / "server" / A2_POOL, published["federation"])
    _print_outcome(p.out, published["federation"], cfg.federated.delta)
    return FederationResult(p.out, published, _records(p.out), p.folder)


def _state_of(p: FederationPlan) -> ServerState:
    return ServerState.load(p.state_file.parent)


def _ledger_of(p: FederationPlan, s: FederatedConfig) -> Ledger:
    return ledger_of(_state_of(p).ledger, s, budget=False)


def run_federation(
    p: FederationPlan,
    s: FederatedConfig,
    report: rounds.Report,
    embedder: Any = None,
    serve_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The federation of plan ``p`` on Flower's simulation engine: ``s.simulation.contributors`` virtual
    players (each built when first sampled) and the server-operated A.2 node, one SuperNode each;
    returns the published adapter's metadata. ``serve_options`` go to :func:`rounds.serve`
    (tests: a seeded ``rng``); the nodes are sampled in the simulation's partition order."""
    from nimmer_train.memory.embedding import SentenceEmbedder

    pool = p.folder / "server" / A2_POOL
    pool.parent.mkdir(parents=True, exist_ok=True)
    if embedder is None:
        embedder = SketchEmbedder() if s.simulation.embedder == "sketch" else SentenceEmbedder()
    population = build_population(p.folder / "devices", s, embedder)
    deliver_uploads(population, pool, s.a2.k)
    a2_node = Node(p.base_dir, p.adapter_dir, a2_pool=pool)  # the server-operated A.2 client, last

    def node_at(partition: int) -> Node:
        if partition == population.size:
            return a2_node
        return Node(p.base_dir, p.adapter_dir, device=population.device(partition))

    partitions: dict[int, int] = {}  # node id -> partition, as the engine registers them
    published: dict[str, Any] = {}
    work = p.state_file.parent

    def setup_of(_: Any, settings_: Any) -> ServerSetup:
        return rounds.make_setup(p.base_dir, p.adapter_dir, work, s, pool)

    def done(_: Any, settings_: Any, setup: ServerSetup, state: ServerState) -> None:
        exposure = record_level_audit(p, s, state, pool)
        published.update(
            results.publish_federated(
                p.out,
                setup.model,
                p.adapter_dir,
                p.fingerprint,
                s,
                state,
                exposure=exposure,
                federation_id=rounds.federation_id(setup.work),
                heldout=(setup.heldout, setup.pad_id),  # the gain's interval (federation.gain)
            )
        )

    options = {"order": partition_order(partitions), **(serve_options or {})}
    sapp = server_app(lambda _: s, setup_of, done, lambda _: report, lambda _: options)
    capp = client_app(lambda ctx: node_at(int(ctx.node_config["partition-id"])), s.secagg.enabled, _drills(s))
    simulate(sapp, capp, population.size + 1, partitions, s.simulation.cpus)
    if not published:
        raise NimmerError("the federation ended without publishing; see the log above")
    return published


def record_level_audit(
    p: FederationPlan, s: FederatedConfig, state: ServerState, pool: Path
) -> dict[str, Any] | None:
    """The privacy report's record-level side, beside the user-level audit: canary exposure of
    the A.2 node's DP-SGD recipe on public stand-in lines over the released rounds, and of a non-DP control
    (:func:`exposure_audit.federation_exposure`)."""
    ledger = ledger_of(state.ledger, s, budget=False)
    released = sum(1 for r in state.records if r.get("accepted"))
    a2_runs = len(ledger.a2) - len(ledger.releases)  # the pool counts' release is no A.2 run
    report = exposure_audit.federation_exposure(p.base_dir, p.adapter_dir, pool, s, released, a2_runs)
    if report is not None:
        log.info(
            "canary exposure (A.2, %d refs): DP %.2f bits (<= 4x), control %.2f bits, %.1f s",
            report["references"], report["dp_mean_exposure_up_to_4x"],
            report["control_mean_exposure_up_to_4x"], report["seconds"],
        )  # fmt: skip
    return report


def partition_order(partitions: dict[int, int]) -> Any:
    """The available node ids in partition order (population order in a simulation)."""

    def order(ids: list[str]) -> list[str]:
        for _ in range(600):  # the engine maps every node as it registers them: a brief wait at most
            if all(int(i) in partitions for i in ids):
                break
            time.sleep(0.05)
        return sorted(ids, key=lambda i: (partitions.get(int(i), len(partitions)), i))

    return order


def _round_metrics(record: dict[str, Any]) -> dict[str, float]:
    """A round's public record (:func:`results.public_record`: no exact node count, no per-node
    bytes) as MLflow metrics."""
    return {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and k != "round"
    }


def _log_start(p: FederationPlan) -> None:
    """What the federation starts from as the run's MLflow dataset inputs: the register adapter
    and the base it fits (digests: their weights' sha256 from their manifests)."""
    for folder, name, context in ((p.adapter_dir, f"adapter {p.register}", "start_adapter"),
                                  (p.base_dir, f"base {p.base_dir.name}", "base")):  # fmt: skip
        manifest = read_manifest(folder)
        sha = next((f["sha256"] for f in manifest["files"] if f["path"].endswith(".safetensors")), None)
        tracking.log_dataset(folder, name, sha or manifest["fingerprint"], context,
                             tags={"fingerprint": manifest["fingerprint"]})  # fmt: skip


def _log_pool(pool: Path, fed: dict[str, Any]) -> None:
    """The A.2 pool as a dataset input, in aggregate only: its name, the sha256 of the pool file
    and the noised upload count the federation published (issue 43: the exact size stays on the
    server). Never a row, a text or an id: only what is tagged here leaves the server."""
    if pool.exists():
        noised = fed.get("uploads_a2")
        tags = {"uploads_noised": str(noised)} if noised is not None else None
        tracking.log_dataset(pool, "a2-pool", sha256_file(pool), "a2_pool", tags=tags)


def _log_federation(fed: dict[str, Any], out: Path, seconds: float) -> None:
    """The federation's privacy outcome, duration, stop reason and records on the stage run. The
    totals go at the last round's step (the rounds logged their own figures, the held-out loss
    before round 1 at step 0), so that an epsilon curve ends on its total and never turns back
    to step 0."""
    records = _records(out)
    last = max((int(r["round"]) for r in records), default=0)
    figures = {
        "epsilon_a1_user_level": fed["epsilon_a1_user_level"],  # None: no privacy guarantee
        "epsilon_a2_record_level": fed["epsilon_a2_record_level"],
        "contributors_a1_noised": fed["contributors_a1"],
        "uploads_a2_noised": fed["uploads_a2"],
        "federation_seconds": seconds,
        **{
            f"canary_exposure_{k}": (fed.get("canary_exposure") or {}).get(k)
            for k in ("dp_mean_exposure_up_to_4x", "control_mean_exposure_up_to_4x", "seconds")
        },
    }
    mlflow.log_metrics({k: float(v) for k, v in figures.items() if v is not None}, step=last)
    mlflow.set_tags({"federated_adapter": str(out), "stopped": str(fed["stopped"])})
    if fed.get("caveats"):  # an epsilon above results.MEANINGFUL_EPSILON: said beside it
        mlflow.set_tag("privacy_caveat", " | ".join(fed["caveats"].values()))
    for name in (results.ROUNDS, results.CONTRIBUTED, results.CARD):
        mlflow.log_artifact(str(out / name), "federation")


def _print_outcome(out: Path, fed: dict[str, Any], delta: float) -> None:
    after = fed["heldout_loss_after"]

    def eps(value: float | None) -> str:
        if value is None:
            return "none (no privacy guarantee)"
        plumbing = " (NO MEANINGFUL GUARANTEE: a plumbing run)" if results.caveat(value) else ""
        return f"{value:.3f}{plumbing}"

    print(
        f"federated adapter: {out} ({fed['rounds']} rounds, stopped: {fed['stopped']}); held-out loss "
        f"{fed['heldout_loss_before']:.3f} -> {after if after is None else f'{after:.3f}'}; epsilon A.1 "
        f"{eps(fed['epsilon_a1_user_level'])} (user), A.2 {eps(fed['epsilon_a2_record_level'])} (record) "
        f"at delta {delta:g}; noised counts: ~{fed['contributors_a1']} A.1 contributors, "
        f"~{fed['uploads_a2']} A.2 uploads"
    )


def _records(out: Path) -> list[dict[str, Any]]:
    return json.loads((out / results.ROUNDS).read_text())


def _drills(s: Any) -> Any:
    if not s.simulation.faults:
        return None
    by_partition = s.simulation.drills()

    def drills(ctx: Any) -> dict[int, str]:
        return by_partition.get(int(ctx.node_config["partition-id"]), {})

    return drills


def quiet_flower_logging() -> None:
    """One line per Flower event, at INFO: Flower's logger (DEBUG, with its own console handler)
    also propagates to the job's handlers, which printed every line twice and the per-node DEBUG
    lines. Where the job has handlers (Hydra's console and log file) Flower's own goes."""
    flower = logging.getLogger("flwr")
    flower.setLevel(logging.INFO)
    if logging.getLogger().handlers:
        for handler in list(flower.handlers):
            if isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler):
                flower.removeHandler(handler)


def simulate(
    sapp: Any, capp: Any, nodes: int, partitions: dict[int, int] | None = None, cpus: int = 0
) -> None:
    """Flower's simulation engine (Ray) on ``cpus`` CPUs (0: the machine's, at most 4), one CPU per
    virtual node, quiet unless something fails. ``partitions`` receives the engine's node id ->
    partition mapping as it registers the nodes (the engine keeps it private: its registration
    function is wrapped for the run)."""
    import warnings

    from flwr.server.superlink.fleet.vce import vce_api
    from flwr.simulation import run_simulation

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # no calls out of the machine
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO", "0")
    cpus = cpus or min(os.cpu_count() or 1, 4)
    register = vce_api._register_nodes

    def registering(num_nodes: int, state_factory: Any) -> dict[int, int]:
        mapping = register(num_nodes, state_factory)
        if partitions is not None:
            partitions.update(mapping)
        return mapping

    vce_api._register_nodes = registering
    quiet_flower_logging()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            run_simulation(
                server_app=sapp,
                client_app=capp,
                num_supernodes=nodes,
                backend_config={
                    "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                    "init_args": {
                        "num_cpus": cpus,
                        "include_dashboard": False,
                        "logging_level": "ERROR",
                    },
                },
            )
    finally:
        vce_api._register_nodes = register
