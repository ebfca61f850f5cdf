"""The publish stage: the built base as the next version and, after a federation, the base with
the federated adapter merged in as the one after it; recorded in MLflow (run + Model Registry)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow

from nimmer_train import tracking
from nimmer_train.artifacts import MANIFEST, README, git_commit, intact_manifest, merged_voice
from nimmer_train.config import Config
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import METADATA, read_metadata
from nimmer_train.publish import mlflow_registry, signoff
from nimmer_train.publish.index import write_index
from nimmer_train.publish.listing import A1, A2, privacy_report
from nimmer_train.publish.rebase import carry, log_decisions, rebase
from nimmer_train.publish.registry import Registry, Version
from nimmer_train.publish.release import PublishRequest, already_published, publish_version, stage_merge
from nimmer_train.publish.signing import Keyring, generate_key

if TYPE_CHECKING:
    from nimmer_train.federation.stage import FederationResult
    from nimmer_train.loras.stage import LoraResult
    from nimmer_train.voice.quality import VoiceReport

log = logging.getLogger(__name__)


def _base_dir(cfg: Config, base_dir: Path | None) -> Path:
    if cfg.publish.base_dir:
        return Path(cfg.publish.base_dir)
    if base_dir is not None:
        return base_dir
    from nimmer_train.base.build import plan
    from nimmer_train.corpus.ingest import find_corpus
    from nimmer_train.synth.synthesize import find_synth

    artifacts = cfg.paths.artifacts_dir()
    corpus = find_corpus(cfg.corpus, artifacts)
    synth = (
        find_synth(cfg.composition, cfg.registers, cfg.teacher, cfg.curation, artifacts)
        if cfg.train.synthetic_share > 0
        else None
    )
    found = plan(cfg, corpus, synth).out
    if intact_manifest(found) is None:
        raise NimmerError(
            f"no built base at {found}: run `python -m pipelines.build_base` with the same overrides "
            "first, or set publish.base_dir"
        )
    return found


def _loras(cfg: Config, base_dir: Path, loras: LoraResult | None) -> list[Path]:
    """The register adapters to publish: run_all's; else ``publish.adapters``; else the ones this
    config's lora settings train on this base (their fingerprints), never the newest on disk."""
    if loras is not None:
        return list(loras.adapters.values())
    if cfg.publish.adapters is not None:
        named = {f"publish.adapters[{i}]": Path(a) for i, a in enumerate(cfg.publish.adapters)}
    else:
        from nimmer_train.loras.stage import configured_adapters

        named = configured_adapters(cfg, base_dir)
    missing = [f"{key} ({folder})" for key, folder in named.items() if intact_manifest(folder) is None]
    if missing:
        raise NimmerError(
            f"no trained adapter for {', '.join(missing)}: run `python -m pipelines.train_loras` with "
            "the same overrides first, or set lora.registers / publish.adapters to the adapters to publish"
        )
    return list(named.values())


def _merge(cfg: Config, loras: LoraResult | None, federation: FederationResult | None) -> Path | None:
    """The adapter to merge, or None. (Its federation's server state is not read: the server keeps
    no contributor ids, so the registry gets no per-contributor rows from a federation.)"""
    p = cfg.publish
    if p.merge_adapter:
        return Path(p.merge_adapter)
    if not (p.merge_federated and cfg.federated.enabled):
        return None
    from nimmer_train.federation.stage import plan_federation

    plan = plan_federation(cfg, loras)
    if federation is None and intact_manifest(plan.out) is None:
        print(f"publish: no federated adapter at {plan.out} (run pipelines.federate); base only")
        return None
    return plan.out


def _evaluation(adapters: list[Path], loras: LoraResult | None) -> dict | None:
    """The register evaluation of exactly these adapters (run_all's, else the one the LoRA stage
    left beside them), for the model card; None when there is none for this set."""
    if loras is not None:
        return loras.evaluation.summary() if loras.evaluation else None
    if not adapters:
        return None
    from nimmer_train.loras.stage import EVALUATION

    found = adapters[0].parent / EVALUATION
    if not found.exists():
        return None
    evaluation = json.loads(found.read_text())
    names = {json.loads((a / METADATA).read_text())["register"]: a.name for a in adapters}
    for kept_for_reruns in ("key", "samples"):  # the LoRA stage's, not the card's
        evaluation.pop(kept_for_reruns, None)
    return evaluation if evaluation.pop("adapters", None) == names else None


def _promote_first(releases: Path, first: Version) -> None:
    """A registry without a production version gets its first one (publish.promote_first)."""
    registry = Registry.open(releases)
    try:
        with registry.writing():
            if "production" in registry.aliases():
                return
            registry.set_alias("production", first, datetime.now(UTC).isoformat(timespec="seconds"))
    finally:
        registry.close()
    print(
        f"publish: {first.label} is production (the registry's first version); later versions stay "
        "candidate until `nimmer versions promote vN`"
    )


def _carried(cfg: Config, releases: Path, req: PublishRequest, candidates: list[Path]) -> PublishRequest:
    """``req`` with the newest version's LoRAs (and ``candidates``, LoRAs the request brings that
    were trained on other weights) decided on its weights before it is signed (publish.rebase);
    a merge is staged first, so the decisions and the version read the same weights."""
    settings = cfg.publish.rebase
    if not settings.enabled or already_published(releases, req):
        return req
    artifacts = cfg.paths.artifacts_dir()
    weights, merged = req.base_dir, None
    if req.merge_adapter is not None:
        weights = stage_merge(req, artifacts)
        req = dataclasses.replace(req, merged_dir=weights)
        merged = merged_voice(read_metadata(req.merge_adapter))
    keyring = Keyring.load(Path(cfg.publish.trusted_keys))
    found = carry(
        releases, artifacts, weights, req.loras, settings, cfg.registers, keyring, candidates, merged
    )
    return req if found is None else dataclasses.replace(req, carry=found)


VoiceMeasure = Callable[[Config, PublishRequest], "VoiceReport | None"]
"""Measures a publish request's voice report (``nimmer_train.runtime.voice_eval.candidate_report``:
the runtime sits above publish, so the caller passes it in)."""


def _voice(
    cfg: Config, releases: Path, req: PublishRequest, measure: VoiceMeasure | None
) -> VoiceReport | None:
    """The voice report for ``req``'s model card; None when publish.voice_eval is off, no measure
    was given or the content is already published (its card already has one)."""
    if measure is None or not cfg.publish.voice_eval.enabled or already_published(releases, req):
        return None
    return measure(cfg, req)


def _log_voice(report: VoiceReport, run_id: str | None) -> None:
    """Print the report; in MLflow its figures as ``voice.vN.<register or all>.<figure>`` metrics
    (the speak stage's names) and the whole of it as ``<label>/voice_report.json``."""
    print("\n".join(report.lines()))
    if run_id:
        mlflow.log_metrics(report.metrics())
        mlflow.log_dict(report.summary(), f"{report.version}/voice_report.json")


def _privacy_metrics(version: Version) -> dict[str, float]:
    """The newest version's privacy figures as the publish run's metrics, each epsilon named by
    its level (no bare ``epsilon``); an epsilon that is none (no player data, no guarantee) is
    left out, never logged as 0."""
    report = privacy_report(version.folder)
    figures = {
        A1: report.get(A1),
        A2: report.get(A2),
        "dp_delta": report.get("delta") if report.get(A1) or report.get(A2) else None,
        "dp_population_n": (report.get("a1_mechanism") or {}).get("population"),
        "contributors_count": version.row["contributors_count"],
    }
    return {k: float(v) for k, v in figures.items() if v is not None}


def _log_signed_inputs(version: Version, releases: Path) -> None:
    """What a version signs, as the publish run's MLflow dataset inputs: its weights (merged
    adapter included), each compatible LoRA; digests are the sha256 in its signed manifest."""
    manifest = json.loads((version.folder / MANIFEST).read_text())
    tracking.log_dataset(
        version.folder, f"{version.label} weights", manifest["weights_sha256"], "signed_weights",
        tags={"version": version.label},
    )  # fmt: skip
    merged = manifest.get("merged_adapter")
    if merged:
        tracking.log_dataset(
            version.folder, f"federated adapter {merged['register']}", merged["fingerprint"],
            "merged_adapter", tags={"version": version.label, "federation": str(merged.get("federation"))},
        )  # fmt: skip
    for lora in manifest.get("compatible_loras") or []:
        files = lora.get("files") or []
        sha = next((f["sha256"] for f in files if str(f.get("path", "")).endswith(".safetensors")), None)
        tracking.log_dataset(
            releases / lora["path"], f"lora {lora['register']} {lora['lora_id'][:12]}",
            sha or lora["fingerprint"], "signed_lora",
            tags={"version": version.label, "relation": lora["relation"]},
        )  # fmt: skip


@dataclass
class PublishResult:
    """The versions this stage published or found already published, oldest first."""

    versions: list[Version]


def publish_stage(
    cfg: Config,
    base_dir: Path | None = None,
    loras: LoraResult | None = None,
    federation: FederationResult | None = None,
    pipeline: str = "publish",
    voice: VoiceMeasure | None = None,
) -> PublishResult:
    """Publish the built base (and, after a federation, the base with its adapter merged in) as
    signed versions in the registry, synced to the MLflow Model Registry. ``voice`` measures each
    new version's voice report for its model card (when publish.voice_eval is on); the entry
    points pass ``nimmer_train.runtime.voice_eval.candidate_report``."""
    p = cfg.publish
    if voice is None and p.voice_eval.enabled:
        log.warning("publish: no voice report measured (publish_stage was given no voice measure)")
    releases = Path(p.releases_dir).resolve()
    base = _base_dir(cfg, base_dir)  # every input is checked before anything is written
    adapters = _loras(cfg, base, loras)
    merge = _merge(cfg, loras, federation)
    key = Path(p.signing_key)
    if not key.exists() and p.create_signing_key:
        kid = generate_key(key, Path(p.trusted_keys))
        print(f"publish: created signing key {kid} at {key} (trusted in {p.trusted_keys})")
    recipe = {"git_commit": git_commit(), "config": json.loads(json.dumps(dataclasses.asdict(cfg)))}
    common = {"recipe": recipe, "license": p.license, "blob_base_url": p.blob_base_url}
    common["evaluation"] = _evaluation(adapters, loras)
    requests = [PublishRequest(base, adapters, **common)]
    if merge is not None:  # its LoRAs were trained on the base: carried by the rebase rule, or not
        requests.append(PublishRequest(base, merge_adapter=merge, **common))
    published = []
    with tracking.stage_run(cfg, pipeline, "publish") as run_id:
        for req in requests:
            req = _carried(cfg, releases, req, adapters if req.merge_adapter else [])
            report = _voice(cfg, releases, req, voice)
            if report is not None:
                req = dataclasses.replace(req, voice=report.summary())
            version, new = publish_version(releases, key, req)
            published.append(version)
            print(
                f"publish: {version.label} {'published' if new else 'already published'} at {version.folder}"
            )
            if report is not None:
                _log_voice(dataclasses.replace(report, version=version.label), run_id)
            carried = rebase(releases, version.label)  # the decisions it was signed with
            if carried is not None:
                print("\n".join(carried.lines()))
                if run_id:
                    log_decisions(carried)
        if p.promote_first:
            _promote_first(releases, published[0])
        write_index(releases, key)  # the mirror's signed index: versions, newest, aliases (publish/index.py)
        if run_id:
            uri = cfg.tracking.tracking_uri()
            registry = Registry.open(releases)
            try:
                registry.set_setting("mlflow_tracking_uri", uri)
                numbers = mlflow_registry.sync(registry, uri, run_id)
            finally:
                registry.close()
            for version in published:
                mlflow.log_artifact(str(version.folder / MANIFEST), version.label)
                mlflow.log_artifact(str(version.folder / README), version.label)
                _log_signed_inputs(version, releases)
            mlflow.log_metrics(_privacy_metrics(published[-1]))
            mlflow.set_tags({v.label: f"{mlflow_registry.BASE_MODEL}/{numbers[v.label]}" for v in published})
            signoff.log_signoff(mlflow.tracking.MlflowClient(uri), run_id, [v.folder for v in published])
    return PublishResult(published)
