"""The rebase stage: the register LoRAs that fit version N, carried to version N+1.

Each LoRA that fits N gets one decision for N+1, recorded in the registry (``lora_rebases``) with
its reason and evidence:

- ``trained_on``: it was trained on N+1's very weights; it fits as it is.
- ``inherited-evaluated``: N+1 is a minor release and, loaded onto N+1's weights beside the other
  inherited LoRAs, it passes the rule on the register x adapter matrix (utterance tokens of its
  register's held-out r1 scenes, :mod:`nimmer_train.loras.evaluation`): bare-base loss minus its
  own >= ``publish.rebase.min_gain`` and best rival adapter's loss minus its own >=
  ``publish.rebase.min_margin``. The evidence is those three cells (loss, interval, n, tokens).
- ``rebased``: retrained on N+1's weights from its recorded data (the synthetic and literary
  datasets its metadata names by fingerprint) and recipe (its recorded LoRA settings and target
  modules), because it failed the rule or N+1 is a major release.
- ``refused``: it does not fit N+1 and was not retrained (``publish.rebase.retrain: false``, its
  recorded data is gone, or its register's voice is merged into N+1's weights).

Releases: each version carries a ``major.minor`` release beside its label (``version_releases``):
the first is 1.0; a later one is a new major when its architecture or tokenizer differs from its
predecessor's (or ``publish.rebase.major`` says so), else the next minor. A major release never
inherits: every LoRA is retrained or refused.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import shutil
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nimmer_train import tracking
from nimmer_train.artifacts import MANIFEST, README, atomic_dir, intact_manifest, sha256_file, write_manifest
from nimmer_train.config.schema import LoraConfig, RebaseConfig
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import WEIGHTS, base_identity, load_base, read_metadata
from nimmer_train.publish.manifest import SIGNATURE
from nimmer_train.publish.registry import Registry, Version, release_label
from nimmer_train.voice.registers import RegistersConfig

if TYPE_CHECKING:
    from nimmer_train.config import Config
    from nimmer_train.loras.evaluation import Scores
    from nimmer_train.loras.train import RegisterData
    from nimmer_train.publish.stage import PublishResult

log = logging.getLogger(__name__)
DECISIONS = ("trained_on", "rebased", "inherited-evaluated", "refused")
# config.json keys that say nothing about the architecture
VOLATILE_CONFIG = {"transformers_version", "_name_or_path", "torch_dtype", "dtype", "use_cache"}


@dataclass(frozen=True)
class Decision:
    lora_id: str
    register: str
    decision: str  # one of DECISIONS
    reason: str
    evidence: dict[str, Any]
    rebased_adapter: str | None = None


@dataclass(frozen=True)
class RebaseResult:
    previous: str
    target: str
    release: tuple[int, int]
    bump: str  # major | minor
    decisions: list[Decision]
    reused: bool = False

    def lines(self) -> list[str]:
        head = f"rebase: {self.previous} -> {release_label(self.target, self.release)}, a {self.bump} release"
        out = [head + (" (decisions already recorded)" if self.reused else "")]
        out += [f"  {d.register:<26} {d.decision:<20} {d.reason}" for d in self.decisions]
        return out


# --- releases: the major/minor meaning of labels -------------------------------------------------


def _config(version: Version) -> dict[str, Any]:
    path = version.folder / "config.json"
    if not path.exists():
        raise NimmerError(
            f"{version.label}: no config.json in {version.folder}; the version folder is incomplete"
        )
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VOLATILE_CONFIG}


def _tokenizer_hashes(version: Version) -> dict[str, str]:
    files = version.row["blob_distribution"]["files"]
    return {f["path"]: f["sha256"] for f in files if f["path"].startswith(("tokenizer", "special_tokens"))}


def architecture_change(previous: Version, new: Version) -> str | None:
    """What makes ``new`` a major release after ``previous`` (architecture or tokenizer), or None."""
    old, cur = _config(previous), _config(new)
    changed = sorted(k for k in old.keys() | cur.keys() if old.get(k) != cur.get(k))
    if changed:
        return f"architecture changed ({', '.join(changed)})"
    if _tokenizer_hashes(previous) != _tokenizer_hashes(new):
        return "tokenizer changed"
    return None


def assign_releases(registry: Registry, target: Version, major: bool | None) -> tuple[int, int]:
    """Give every version up to ``target`` without a release one, oldest first; ``major`` forces
    (True/False) or leaves to the architecture rule (None) the target's kind. Returns the target's."""
    previous: Version | None = None
    for version in registry.versions():
        if version.row["version_number"] > target.row["version_number"]:
            break
        recorded = registry.release(version)
        forced = major if version.id == target.id else None
        if recorded is not None:
            if forced is not None and previous is not None:
                was_major = recorded[0] > (registry.release(previous) or (0, 0))[0]
                if was_major != forced:
                    raise NimmerError(
                        f"{version.label} is already release {recorded[0]}.{recorded[1]}; "
                        f"publish.rebase.major={forced} cannot change it (set it to null)"
                    )
            previous = version
            continue
        if previous is None:
            release, why = (1, 0), "the registry's first version"
        else:
            last = registry.release(previous)
            assert last is not None
            change = architecture_change(previous, version)
            if forced is True or (forced is None and change):
                release, why = (last[0] + 1, 0), change or "publish.rebase.major=true"
            else:
                release, why = (last[0], last[1] + 1), "same architecture and tokenizer"
        registry.set_release(version, *release, why)
        previous = version
    found = registry.release(target)
    assert found is not None
    return found


# --- the recorded data and recipe of a LoRA ------------------------------------------------------


@dataclass(frozen=True)
class Recipe:
    """What a LoRA was trained from, found again under the artifacts folder."""

    folder: Path  # the LoRA in releases/loras/
    meta: dict[str, Any]
    settings: LoraConfig
    data: RegisterData


def _dataset(artifacts: Path, kind: str, fp: str) -> Path | None:
    found = [p for p in sorted((artifacts / kind).glob(f"*-{fp[:12]}")) if intact_manifest(p)]
    return found[0] if found else None


def recipe(row: dict[str, Any], releases: Path, artifacts: Path, catalogue: RegistersConfig) -> Recipe | str:
    """The LoRA's recorded data and recipe, or why they cannot be found."""
    from datasets import load_from_disk

    from nimmer_train.loras.train import register_data

    folder = releases / row["path"]
    meta = read_metadata(folder)
    datasets, lora = meta.get("datasets") or {}, meta.get("lora")
    if not lora or not {"synth", "corpus"} <= set(datasets):
        return f"its metadata records no training data or recipe ({folder / 'nimmer_adapter.json'})"
    synth, corpus = (
        _dataset(artifacts, "synth", datasets["synth"]),
        _dataset(artifacts, "corpus", datasets["corpus"]),
    )
    if synth is None or corpus is None:
        missing = "synthetic" if synth is None else "literary"
        fp = datasets["synth" if synth is None else "corpus"]
        return f"its recorded {missing} dataset {fp[:12]} is not under {artifacts}"
    try:
        settings = LoraConfig(**lora)
        register = catalogue.get(row["register"])
    except (TypeError, NimmerError) as exc:
        return f"its recorded recipe no longer composes ({exc})"
    r1, literary = load_from_disk(str(synth / "r1")), load_from_disk(str(corpus / "dataset"))
    return Recipe(folder, meta, settings, register_data(row["register"], register, r1, literary, settings))


# --- the matrix of inherited LoRAs on the new weights --------------------------------------------


def inherited_matrix(
    base: Path, adapters: dict[str, Path], heldout: dict[str, list], max_length: dict[str, int], seed: int
) -> Scores:
    """Utterance-token scores of the r1 held-out scenes under ``base`` alone and with each of
    ``adapters`` (trained on other weights, loaded anyway: that is the question)."""
    from peft import PeftModel
    from transformers import AutoTokenizer

    from nimmer_train.loras.evaluation import BASE, TOKEN_CLASSES, _class_sums, _losses, score, token_classes

    tokenizer = AutoTokenizer.from_pretrained(base)
    names = list(adapters)
    model = PeftModel.from_pretrained(load_base(base), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name, is_trainable=False)
    model.eval()
    columns = [BASE, *names]
    sums, counts = {}, {}
    for data in names:
        batch = [token_classes(tokenizer, c, max_length[data]) for c in heldout.get(data, [])]
        sums[data] = np.zeros((len(batch), len(columns), len(TOKEN_CLASSES)))
        counts[data] = np.zeros((len(batch), len(TOKEN_CLASSES)), dtype=int)
        for j, col in enumerate(columns):
            for i, (losses, row) in enumerate(zip(_losses(model, col, batch, tokenizer), batch, strict=True)):
                sums[data][i, j], counts[data][i] = _class_sums(losses, row["classes"])
    return score(columns, sums, counts, seed)["utterance"]


def _cell(cell: Any) -> dict[str, Any]:
    return {
        k: (None if isinstance(v, float) and not math.isfinite(v) else v)
        for k, v in dataclasses.asdict(cell).items()
    }


def judge(register: str, scores: Scores, settings: RebaseConfig) -> tuple[bool, str, dict[str, Any]]:
    """(fits, reason, evidence): the rule on ``register``'s row of the matrix."""
    from nimmer_train.loras.evaluation import BASE

    rule = {
        "min_gain": settings.min_gain,
        "min_margin": settings.min_margin,
        "set": "r1",
        "tokens": "utterance",
    }
    row = scores.matrix.get(register)
    if row is None:
        return False, "no held-out r1 scenes of its register: nothing to judge it by", {"rule": rule}
    own, base = row[register], row[BASE]
    rivals = {c: cell for c, cell in row.items() if c not in (BASE, register)}
    rival = min(rivals, key=lambda c: rivals[c].loss) if rivals else None
    gain = base.loss - own.loss
    margin = rivals[rival].loss - own.loss if rival else None
    evidence = {
        "rule": rule,
        "cells": {
            "own": _cell(own),
            "base": _cell(base),
            **({"best_rival": {"adapter": rival, **_cell(rivals[rival])}} if rival else {}),
        },
        "gain": gain if math.isfinite(gain) else None,
        "margin": margin if margin is not None and math.isfinite(margin) else None,
    }
    if not math.isfinite(gain):
        return False, "its register's held-out scenes have no utterance tokens", evidence
    text = f"gain {gain:+.3f} (>= {settings.min_gain:g}?)"
    if rival is not None:
        text += f", margin {margin:+.3f} over {rival} (>= {settings.min_margin:g}?)"
    fits = gain >= settings.min_gain and (margin is None or margin >= settings.min_margin)
    return fits, text + " on utterance tokens of its register's held-out r1 scenes", evidence


# --- retraining on the new weights ---------------------------------------------------------------


def base_folder(target: Version, artifacts: Path) -> Path:
    """A base folder (with an artifacts manifest, what training reads) holding ``target``'s
    weights: the built base that has them, else a copy of the version's model files."""
    weights = target.row["weights_sha256"]
    for folder in sorted((artifacts / "base").glob("*")) if (artifacts / "base").is_dir() else []:
        if intact_manifest(folder) and base_identity(folder)["weights_sha256"] == weights:
            return folder
    out = artifacts / "rebase" / target.label
    if intact_manifest(out) and base_identity(out)["weights_sha256"] == weights:
        return out
    with atomic_dir(out) as staging:
        for item in target.folder.iterdir():
            if item.is_file() and item.name not in (MANIFEST, SIGNATURE, README):
                shutil.copy2(item, staging / item.name)
        if sha256_file(staging / WEIGHTS) != weights:
            raise NimmerError(
                f"{target.folder / WEIGHTS} is not the weights the registry recorded; re-pull the version"
            )
        write_manifest(staging, "base", target.row["content_fingerprint"], {"version": target.label})
    return out


def retrain(name: str, found: Recipe, base: Path, artifacts: Path, catalogue: RegistersConfig) -> Path:
    """The LoRA retrained on ``base`` from its recorded data and recipe (an intact one is reused)."""
    from nimmer_train.loras.train import adapter_fingerprint, publish_adapter, train_adapter, work_dir

    identity = base_identity(base)
    register = catalogue.get(name)
    datasets = found.meta["datasets"]
    fp = adapter_fingerprint(name, register, identity, datasets, found.settings)
    trained = artifacts / "loras" / base.name / f"{name}-{fp[:12]}"  # train_loras made this very one
    if intact_manifest(trained):
        return trained
    out = artifacts / "rebase" / "loras" / base.name / trained.name
    if intact_manifest(out):
        return out
    modules = (
        found.meta.get("target_modules")
        or json.loads((found.folder / "adapter_config.json").read_text())["target_modules"]
    )
    model, metrics = train_adapter(
        name, found.data, base, found.settings, list(modules), work_dir(out), lambda m, s: None
    )
    meta = {
        **{k: found.meta[k] for k in ("traits",) if k in found.meta},
        "register": name,
        "base": identity,
        "datasets": datasets,
        "training_config_hash": fp,
        "lora": dataclasses.asdict(found.settings),
        "target_modules": list(modules),
        "metrics": metrics,
        "rebased_from": found.folder.name,
    }
    publish_adapter(model, out, fp, meta)
    return out


# --- the stage -----------------------------------------------------------------------------------


def previous_of(registry: Registry, target: Version) -> Version | None:
    """The version published just before ``target``, or None."""
    older = [v for v in registry.versions() if v.row["version_number"] < target.row["version_number"]]
    return older[-1] if older else None


def rebase(
    releases: Path,
    artifacts: Path,
    target_name: str,
    catalogue: RegistersConfig,
    settings: RebaseConfig,
    previous_name: str | None = None,
) -> RebaseResult | None:
    """Decide, record and (where retraining) do the carrying of ``previous``'s LoRAs to
    ``target``; None when ``target`` has no previous version."""
    registry = Registry.open(releases)
    try:
        target = registry.find(target_name)
        previous = registry.find(previous_name) if previous_name else previous_of(registry, target)
        if previous is None:
            return None
        if previous.row["version_number"] >= target.row["version_number"]:
            raise NimmerError(f"rebase goes forward: {previous.label} is not older than {target.label}")
        with registry.writing():
            release = assign_releases(registry, target, settings.major)
            prev_release = assign_releases(registry, previous, None)
        bump = "major" if release[0] > prev_release[0] else "minor"
        inherited = registry.loras_for(previous)
        recorded = {r["lora_id"]: r for r in registry.rebases_into(target)}
        rule = {k: getattr(settings, k) for k in ("min_gain", "min_margin", "retrain", "eval_max_examples")}
        if inherited and all(
            (r := recorded.get(lora["lora_id"])) and r["evidence"].get("settings") == rule
            for lora in inherited
        ):
            kept = [_from_row(recorded[lora["lora_id"]]) for lora in inherited]
            return RebaseResult(previous.label, target.label, release, bump, kept, reused=True)
        decisions = _decide(target, inherited, bump, releases, artifacts, catalogue, settings)
        now = datetime.now(UTC).isoformat(timespec="seconds")
        with registry.writing():
            for d in decisions:
                evidence = {
                    **d.evidence,
                    "bump": bump,
                    "from": previous.label,
                    "to": target.label,
                    "release": f"{release[0]}.{release[1]}",
                    "settings": rule,
                }
                row = {**dataclasses.asdict(d), "evidence": evidence, "decided_at": now}
                registry.record_rebase({**row, "from_version_id": previous.id, "to_version_id": target.id})
        return RebaseResult(previous.label, target.label, release, bump, decisions)
    finally:
        registry.close()


def _from_row(row: dict[str, Any]) -> Decision:
    return Decision(
        row["lora_id"],
        row["register"],
        row["decision"],
        row["reason"],
        row["evidence"],
        row["rebased_adapter"],
    )


def _decide(
    target: Version,
    inherited: list[dict[str, Any]],
    bump: str,
    releases: Path,
    artifacts: Path,
    catalogue: RegistersConfig,
    settings: RebaseConfig,
) -> list[Decision]:
    merged = (json.loads((target.folder / MANIFEST).read_text()).get("merged_adapter") or {}).get("register")
    decided: dict[str, Decision] = {}
    recipes: dict[str, Recipe] = {}
    for lora in inherited:
        lid, name = lora["lora_id"], lora["register"]
        if lora["trained_on_weights_sha256"] == target.row["weights_sha256"]:
            decided[lid] = Decision(lid, name, "trained_on", f"trained on {target.label}'s very weights", {})
        elif name == merged:
            reason = f"its register's voice is merged into {target.label}'s weights; it would apply twice"
            decided[lid] = Decision(lid, name, "refused", reason, {})
        else:
            found = recipe(lora, releases, artifacts, catalogue)
            if isinstance(found, str):
                decided[lid] = Decision(lid, name, "refused", f"cannot evaluate or retrain: {found}", {})
            else:
                recipes[lid] = found
    verdicts: dict[str, tuple[bool, str, dict[str, Any]]] = {}
    if bump == "minor" and recipes:
        scores = inherited_matrix(
            target.folder,
            {f.meta["register"]: f.folder for f in recipes.values()},
            {
                f.meta["register"]: f.data.heldout["r1"][: settings.eval_max_examples]
                for f in recipes.values()
            },
            {f.meta["register"]: f.settings.max_length for f in recipes.values()},
            seed=0,
        )
        verdicts = {lid: judge(f.meta["register"], scores, settings) for lid, f in recipes.items()}
    for lid, found in recipes.items():
        name = found.meta["register"]
        if bump == "major":
            fits, why, evidence = False, "a major release invalidates inherited LoRAs", {}
        else:
            fits, why, evidence = verdicts[lid]
        if fits:
            decided[lid] = Decision(lid, name, "inherited-evaluated", f"fits: {why}", evidence)
        elif settings.retrain:
            out = retrain(name, found, base_folder(target, artifacts), artifacts, catalogue)
            what = (
                "retrained on its recorded data and recipe" if bump == "major" else "does not fit, retrained"
            )
            decided[lid] = Decision(lid, name, "rebased", f"{what}: {why}", evidence, str(out))
        else:
            decided[lid] = Decision(
                lid, name, "refused", f"does not fit and publish.rebase.retrain is false: {why}", evidence
            )
    return [decided[lora["lora_id"]] for lora in inherited]


def rebase_stage(
    cfg: Config, published: PublishResult | None = None, pipeline: str = "rebase"
) -> RebaseResult | None:
    """Carry the LoRAs of the version before the newest published one (run_all's, else the
    registry's newest) to it, in one MLflow run; prints each decision."""
    releases = Path(cfg.publish.releases_dir).resolve()
    if published and published.versions:
        target = published.versions[-1].label
    else:
        registry = Registry.open(releases)
        try:
            versions = registry.versions()
        finally:
            registry.close()
        if not versions:
            raise NimmerError(f"no version in {releases}: publish one first (`python -m pipelines.publish`)")
        target = versions[-1].label
    with tracking.stage_run(cfg, pipeline, "rebase") as run_id:
        result = rebase(releases, cfg.paths.artifacts_dir(), target, cfg.registers, cfg.publish.rebase)
        if result is None:
            print(f"rebase: {target} is the first version; no LoRAs to carry")
            return None
        if run_id:
            import mlflow

            mlflow.log_dict(
                {"decisions": [dataclasses.asdict(d) for d in result.decisions]}, "rebase/decisions.json"
            )
            mlflow.log_metrics(
                {f"rebase.{k}": sum(d.decision == k for d in result.decisions) for k in DECISIONS}
            )
            mlflow.set_tags(
                {"rebase.from": result.previous, "rebase.to": result.target, "rebase.bump": result.bump}
            )
    print("\n".join(result.lines()))
    return result
