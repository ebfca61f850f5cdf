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
  modules), because it failed the rule, N+1 is a major release, or N+1 merges a register's
  adapter and ``publish.rebase.retrain_after_merge`` is set (the merged voice pulls the others
  toward it, which the loss rule does not see).
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from nimmer_train.artifacts import MANIFEST, intact_manifest, lora_path, rebased_lora_path, sha256_file
from nimmer_train.config.schema import LoraConfig, RebaseConfig
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import base_identity, load_base, read_metadata
from nimmer_train.publish.registry import Registry, Version, release_label
from nimmer_train.voice.registers import RegistersConfig

if TYPE_CHECKING:
    from nimmer_train.config import Config
    from nimmer_train.loras.evaluation import Scores
    from nimmer_train.loras.train import RegisterData
    from nimmer_train.publish.signing import Keyring

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

    def lines(self) -> list[str]:
        out = [
            f"rebase: {self.previous} -> {release_label(self.target, self.release)}, a {self.bump} release"
        ]
        out += [f"  {d.register:<26} {d.decision:<20} {d.reason}" for d in self.decisions]
        return out


# --- releases: the major/minor meaning of labels -------------------------------------------------


def _config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.exists():
        raise NimmerError(f"no config.json in {folder}; the model folder is incomplete")
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in VOLATILE_CONFIG}


def _tokenizer_hashes(folder: Path) -> dict[str, str]:
    return {
        p.name: sha256_file(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name.startswith(("tokenizer", "special_tokens"))
    }


def architecture_change(previous: Path, new: Path) -> str | None:
    """What makes the model in folder ``new`` a major release after the one in ``previous``
    (architecture or tokenizer), or None."""
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
            change = architecture_change(previous.folder, version.folder)
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


def retrain(name: str, found: Recipe, base: Path, artifacts: Path, catalogue: RegistersConfig) -> Path:
    """The LoRA retrained on ``base`` from its recorded data and recipe (an intact one is reused)."""
    from nimmer_train.loras.train import adapter_fingerprint, publish_adapter, train_adapter, work_dir

    identity = base_identity(base)
    register = catalogue.get(name)
    datasets = found.meta["datasets"]
    fp = adapter_fingerprint(name, register, identity, datasets, found.settings)
    trained = lora_path(artifacts, base.name, name, fp)  # train_loras made this very one
    if intact_manifest(trained):
        return trained
    out = rebased_lora_path(artifacts, base.name, name, fp)
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


# --- carrying, decided before the new version is signed ----------------------------------------


@dataclass(frozen=True)
class Carry:
    """The decisions on the LoRAs of ``previous`` for a version not yet signed, made on its
    weights: publish lists ``inherited`` and ``rebased`` as fitting it, signs ``manifest_entry``
    and records the decisions in the registry, in the transaction that makes the version visible."""

    previous: Version
    bump: str  # major | minor
    rule: dict[str, Any]
    decisions: list[Decision]
    kept: list[Path]  # previous LoRAs listed as they are: inherited-evaluated, or trained on these weights
    rebased: list[Path]  # LoRAs retrained on the new weights

    def manifest_entry(self) -> dict[str, Any]:
        return {
            "from": self.previous.label,
            "bump": self.bump,
            "rule": self.rule,
            "decisions": [
                {k: getattr(d, k) for k in ("lora_id", "register", "decision", "reason")}
                for d in self.decisions
            ],
        }

    def registry_rows(self, to_version_id: str, decided_at: str) -> list[dict[str, Any]]:
        """The ``lora_rebases`` rows: each decision with its evidence, the bump and the rule."""
        common = {"bump": self.bump, "from": self.previous.label, "settings": self.rule}
        return [
            {
                **dataclasses.asdict(d),
                "evidence": {**d.evidence, **common},
                "decided_at": decided_at,
                "from_version_id": self.previous.id,
                "to_version_id": to_version_id,
            }
            for d in self.decisions
        ]


def _candidate(folder: Path) -> dict[str, Any]:
    """A LoRA folder outside the registry as a row like the registry's."""
    manifest = intact_manifest(folder)
    if manifest is None:
        raise NimmerError(f"adapter {folder} is incomplete or changed (its manifest does not match)")
    meta = read_metadata(folder)
    return {
        "lora_id": f"{meta['register']}-{manifest['fingerprint'][:12]}",
        "register": meta["register"],
        "path": str(folder.resolve()),
        "trained_on_weights_sha256": meta["base"]["weights_sha256"],
    }


def carry(
    releases: Path,
    artifacts: Path,
    weights: Path,
    own: list[Path],
    settings: RebaseConfig,
    catalogue: RegistersConfig,
    keyring: Keyring,
    candidates: list[Path] = (),  # type: ignore[assignment]
    merged_register: str | None = None,
) -> Carry | None:
    """Decide, for a version about to be published with the model in ``weights`` (an artifacts
    folder) and the LoRAs ``own`` trained on it, what becomes of the LoRAs that the registry's
    newest version lists in its verified signed manifest (and of ``candidates``, LoRAs trained on
    other weights that the request brings): keep, retrain (into ``artifacts``) or refuse each,
    one LoRA per register. None when the registry has no version."""
    from nimmer_train.publish.versions import verify_version

    registry = Registry.open(releases, create=True)
    try:
        versions = registry.versions()
        if not versions:
            return None
        previous = versions[-1]
        verified = verify_version(registry, previous, keyring)  # the signed LoRAs, not the registry's rows
    finally:
        registry.close()
    rows = {(row := _candidate(folder))["lora_id"]: row for folder in verified.loras.values()}
    holder = {row["register"]: lid for lid, row in rows.items()}
    extra = []
    for folder in candidates:
        row = _candidate(folder)
        lid, name = row["lora_id"], row["register"]
        if lid in rows:
            continue
        if name in holder:
            reason = f"{holder[name]} carries its register from {previous.label} (one LoRA per register)"
            extra.append(Decision(lid, name, "refused", reason, {}))
            continue
        rows[lid], holder[name] = row, lid
    change = architecture_change(previous.folder, weights)  # previous.folder: verified above
    major = settings.major if settings.major is not None else change is not None
    bump = "major" if major else "minor"
    keys = ("min_gain", "min_margin", "retrain", "retrain_after_merge", "eval_max_examples")
    rule = {k: getattr(settings, k) for k in keys}
    own_registers = {read_metadata(f)["register"]: f for f in own}
    decisions = _decide(
        weights,
        list(rows.values()),
        bump,
        own_registers,
        merged_register,
        releases,
        artifacts,
        catalogue,
        settings,
    )
    kept = ("inherited-evaluated", "trained_on")
    return Carry(
        previous,
        bump,
        rule,
        decisions + extra,
        [_folder(releases, rows[d.lora_id]) for d in decisions if d.decision in kept],
        [Path(d.rebased_adapter) for d in decisions if d.decision == "rebased" and d.rebased_adapter],
    )


def _folder(releases: Path, row: dict[str, Any]) -> Path:
    return releases / row["path"]  # an absolute path (a candidate) stays as it is


def _decide(
    weights: Path,
    inherited: list[dict[str, Any]],
    bump: str,
    own: dict[str, Path],
    merged: str | None,
    releases: Path,
    artifacts: Path,
    catalogue: RegistersConfig,
    settings: RebaseConfig,
) -> list[Decision]:
    sha = base_identity(weights)["weights_sha256"]
    decided: dict[str, Decision] = {}
    recipes: dict[str, Recipe] = {}
    for lora in inherited:
        lid, name = lora["lora_id"], lora["register"]
        if name == merged:
            reason = "its register's voice is merged into the new weights; it would apply twice"
            decided[lid] = Decision(lid, name, "refused", reason, {})
        elif name in own:
            reason = f"superseded by {own[name].name}, trained on the new weights"
            decided[lid] = Decision(lid, name, "refused", reason, {})
        elif lora["trained_on_weights_sha256"] == sha:
            decided[lid] = Decision(lid, name, "trained_on", "trained on the new version's very weights", {})
        else:
            found = recipe(lora, releases, artifacts, catalogue)
            if isinstance(found, str):
                decided[lid] = Decision(lid, name, "refused", f"cannot evaluate or retrain: {found}", {})
            else:
                recipes[lid] = found
    verdicts: dict[str, tuple[bool, str, dict[str, Any]]] = {}
    after_merge = merged is not None and settings.retrain_after_merge
    if bump == "minor" and recipes and not after_merge:
        scores = inherited_matrix(
            weights,
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
        elif after_merge:
            why = f"the new weights merge {merged}'s voice (publish.rebase.retrain_after_merge)"
            fits, evidence = False, {}
        else:
            fits, why, evidence = verdicts[lid]
        if fits:
            decided[lid] = Decision(lid, name, "inherited-evaluated", f"fits: {why}", evidence)
        elif settings.retrain:
            out = retrain(name, found, weights, artifacts, catalogue)
            what = (
                "retrained on its recorded data and recipe" if bump == "major" else "does not fit, retrained"
            )
            decided[lid] = Decision(lid, name, "rebased", f"{what}: {why}", evidence, str(out))
        else:
            decided[lid] = Decision(
                lid, name, "refused", f"does not fit and publish.rebase.retrain is false: {why}", evidence
            )
    return [decided[lora["lora_id"]] for lora in inherited]


# --- what was decided, from the registry ---------------------------------------------------------


def rebase(releases: Path, target_name: str) -> RebaseResult | None:
    """The decisions recorded when ``target`` was published (and its release, assigned by the
    bump its signed manifest states when not yet recorded); None when it carried nothing (the
    registry's first version, or published with publish.rebase.enabled=false)."""
    registry = Registry.open(releases)
    try:
        target = registry.find(target_name)
        entry = json.loads((target.folder / MANIFEST).read_text()).get("lora_carry")
        if not entry:
            return None
        with registry.writing():
            release = assign_releases(registry, target, entry["bump"] == "major")
        rows = registry.rebases_into(target)
        decisions = [_from_row(r) for r in rows] or [  # a pulled version: its signed decisions
            Decision(d["lora_id"], d["register"], d["decision"], d["reason"], {}) for d in entry["decisions"]
        ]
        return RebaseResult(entry["from"], target.label, release, entry["bump"], decisions)
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


def log_decisions(result: RebaseResult) -> None:
    """The decisions into the active MLflow run: a JSON artifact, counts per decision, tags."""
    import mlflow

    mlflow.log_dict(
        {"decisions": [dataclasses.asdict(d) for d in result.decisions]},
        f"{result.target}/rebase_decisions.json",
    )
    mlflow.log_metrics({f"rebase.{k}": sum(d.decision == k for d in result.decisions) for k in DECISIONS})
    mlflow.set_tags({"rebase.from": result.previous, "rebase.to": result.target, "rebase.bump": result.bump})


def rebase_stage(cfg: Config, version: str | None = None) -> RebaseResult | None:
    """Print the carrying decisions recorded for ``version`` (the registry's newest by default)."""
    releases = Path(cfg.publish.releases_dir).resolve()
    registry = Registry.open(releases)
    try:
        versions = registry.versions()
    finally:
        registry.close()
    if not versions:
        raise NimmerError(f"no version in {releases}: publish one first (`python -m pipelines.publish`)")
    target = version or versions[-1].label
    result = rebase(releases, target)
    if result is None:
        why = "the first version, or published with publish.rebase.enabled=false"
        print(f"rebase: {target} carried no LoRAs ({why})")
        return None
    print("\n".join(result.lines()))
    return result
