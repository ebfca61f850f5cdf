"""The train_loras stage: one nested MLflow run per register adapter, then the evaluation on the
parent run: loss matrices per evaluation set and token class (CSV with n and intervals, image),
separability and mean gain on utterance tokens with bootstrap intervals, sample generations; and
``evaluation.json`` beside the adapters, which the publish stage puts in the model card."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlflow
from datasets import load_from_disk

from nimmer_train import tracking
from nimmer_train.artifacts import (
    MANIFEST,
    fingerprint,
    intact_manifest,
    lora_path,
    loras_path,
    source_fingerprint,
    write_json_atomic,
)
from nimmer_train.base.build import plan
from nimmer_train.config import Config
from nimmer_train.corpus.ingest import IngestResult, find_corpus
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import base_identity
from nimmer_train.loras.evaluation import BASE, EVAL_SETS, HEADLINE, TOKEN_CLASSES, Evaluation, evaluate
from nimmer_train.loras.train import (
    RegisterData,
    adapter_fingerprint,
    check_hardware,
    publish_adapter,
    register_data,
    train_adapter,
    work_dir,
)
from nimmer_train.progress import Progress, with_progress
from nimmer_train.synth.synthesize import SynthResult, find_synth
from nimmer_train.voice.registers import Register, teachers_view

log = logging.getLogger(__name__)
EVALUATION = "evaluation.json"  # in the adapters' folder: the last evaluation and the adapters it scored


@dataclass(frozen=True)
class LoraResult:
    root: Path
    adapters: dict[str, Path]
    skipped: dict[str, str]
    evaluation: Evaluation | None


def train_loras_stage(
    cfg: Config,
    corpus: IngestResult | None = None,
    synth: SynthResult | None = None,
    base_dir: Path | None = None,
    pipeline: str = "train_loras",
) -> LoraResult:
    settings = cfg.lora
    check_hardware(settings)
    inputs = _inputs(cfg, corpus, synth, base_dir)
    adapters: dict[str, Path] = {}
    heldout: dict[str, dict[str, list]] = {name: {} for name in EVAL_SETS}
    skipped: dict[str, str] = {}
    evaluation = None
    with tracking.stage_run(cfg, pipeline, "train_loras") as parent:
        _log_inputs(inputs, cfg.corpus.name)
        for name in inputs.names:
            register = cfg.registers.get(name)
            data = register_data(name, register, inputs.r1, inputs.literary, settings)
            if data.r1_examples < settings.min_examples:
                skipped[name] = (
                    f"{data.r1_examples} r1 conversations < lora.min_examples={settings.min_examples}"
                )
                log.warning("skipping register %s: %s", name, skipped[name])
                continue
            adapters[name] = _adapter(cfg, pipeline, inputs, name, register, data)
            for set_name in EVAL_SETS:
                heldout[set_name][name] = data.heldout[set_name]
        if any(heldout[HEADLINE[0]].values()):
            evaluation = _evaluation(inputs, adapters, heldout, cfg)
            if parent:
                _log_evaluation(evaluation)
        if parent:
            mlflow.set_tags({"base": inputs.base["label"], "skipped": str(skipped)})
    if evaluation:
        head = evaluation.headline
        sep, gain = head.separability, head.mean_gain
        n = ", ".join(f"{r} {row[BASE].n}" for r, row in head.matrix.items())
        print(
            f"adapters: {inputs.root} ({len(adapters)} registers); on utterance tokens of held-out "
            f"scenes: separability {sep.value:.2f} [{sep.low:.2f}, {sep.high:.2f}], mean loss gain "
            f"over base {gain.value:.3f} [{gain.low:.3f}, {gain.high:.3f}] (n: {n})"
        )
    return LoraResult(inputs.root, adapters, skipped, evaluation)


def _evaluation(
    inputs: _Inputs, adapters: dict[str, Path], heldout: dict[str, dict[str, list]], cfg: Config
) -> Evaluation:
    """The held-out matrix of ``adapters``: the one ``evaluation.json`` holds when its key matches
    (:func:`_evaluation_key`: the adapters' and the base's bytes, the code that scores and samples,
    the settings), so a rerun does no work; else measured and written there."""
    key = _evaluation_key(inputs, adapters, cfg)
    path = inputs.root / EVALUATION
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and kept.get("key") == key:
            evaluation = Evaluation.from_summary(kept, kept["samples"])
            if set(evaluation.scores) == set(EVAL_SETS) and all(
                set(by) == set(TOKEN_CLASSES) for by in evaluation.scores.values()
            ):
                log.info("held-out matrix of these adapters is up to date in %s; not measured again", path)
                return evaluation
    except (OSError, ValueError, KeyError, TypeError, AttributeError):  # none, or not the stage's own
        pass
    evaluation = evaluate(inputs.base_dir, adapters, heldout, cfg.registers, cfg.lora)
    names = {n: p.name for n, p in adapters.items()}
    write_json_atomic(
        path, {"adapters": names, "key": key, **evaluation.summary(), "samples": evaluation.samples}
    )
    return evaluation


def _evaluation_key(inputs: _Inputs, adapters: dict[str, Path], cfg: Config) -> dict[str, Any]:
    """What a held-out matrix depends on: each adapter's and the base's manifest (their files'
    sha256: a retrained adapter under the same name differs), the code that scores the matrix
    and samples the replies, the evaluation settings and the register catalogue (the samples'
    knobs)."""
    from nimmer_train.loras import evaluation
    from nimmer_train.voice import prompt_dsl, registers, sampling, structured

    def manifest_sha(folder: Path) -> str | None:
        try:
            return hashlib.sha256((folder / MANIFEST).read_bytes()).hexdigest()
        except OSError:
            return None

    s = cfg.lora
    return {
        "adapters": {n: [p.name, manifest_sha(p)] for n, p in adapters.items()},
        "base": [inputs.base_dir.name, manifest_sha(inputs.base_dir)],
        "code": source_fingerprint(evaluation, prompt_dsl, sampling, structured, registers),
        "settings": {
            k: getattr(s, k)
            for k in ("eval_max_examples", "max_length", "dtype", "seed", "sample_max_new_tokens")
        },
        "registers": fingerprint(teachers_view(cfg.registers)),
    }


@dataclass(frozen=True)
class _Inputs:
    """What every register's adapter is trained from, and where the adapters go."""

    corpus: IngestResult
    synth: SynthResult
    base_dir: Path
    base: dict[str, str]  # the base's identity (label, weights sha256)
    names: list[str]  # the registers to train
    r1: Any  # the synthetic r1 conversations (DatasetDict)
    literary: Any  # the literary corpus (DatasetDict)
    root: Path  # artifacts/loras/<base>/

    @property
    def datasets(self) -> dict[str, str]:
        return {"synth": self.synth.fingerprint, "corpus": self.corpus.fingerprint}


def _inputs(
    cfg: Config, corpus: IngestResult | None, synth: SynthResult | None, base_dir: Path | None
) -> _Inputs:
    """The corpus, synthetic data and base (run_all's, else found or made from the config); the
    registers to train, checked against the catalogue."""
    settings = cfg.lora
    artifacts = cfg.paths.artifacts_dir()
    synth = synth or find_synth(cfg.composition, cfg.registers, cfg.teacher, cfg.curation, artifacts)
    corpus = corpus or find_corpus(cfg.corpus, artifacts)  # found, never built: inputs before work
    base_dir = Path(settings.base_dir) if settings.base_dir else base_dir or plan(cfg, corpus, synth).out
    if not (base_dir / MANIFEST).exists():
        raise NimmerError(
            f"no published base at {base_dir}: run `python -m pipelines.build_base` with the "
            "same overrides first, or point lora.base_dir at a base folder"
        )
    base = base_identity(base_dir)
    names = settings.registers if settings.registers is not None else cfg.registers.names
    for name in names:
        cfg.registers.get(name)  # an unknown register fails here, naming the known ones
    r1 = load_from_disk(str(synth.path / "r1"))
    literary = load_from_disk(str(corpus.dataset_dir))
    return _Inputs(corpus, synth, base_dir, base, names, r1, literary, loras_path(artifacts, base_dir.name))


def _log_inputs(inputs: _Inputs, corpus_name: str) -> None:
    """What the adapters are trained from, as the run's MLflow dataset inputs: the synthetic r1
    and the literary corpus (each register's examples come from both) and the base's weights."""
    r1 = inputs.synth.path / "r1" / "train"
    tracking.log_dataset(
        r1, "synthetic-r1-train", inputs.synth.fingerprint, "training", dataset=inputs.r1["train"]
    )
    corpus = inputs.corpus.dataset_dir / "train"
    tracking.log_dataset(
        corpus,
        f"{corpus_name}-train",
        inputs.corpus.fingerprint,
        "training",
        dataset=inputs.literary["train"],
    )
    tracking.log_dataset(
        inputs.base_dir, f"base {inputs.base['label']}", inputs.base["weights_sha256"], "base",
        tags={"fingerprint": inputs.base["fingerprint"]},
    )  # fmt: skip


def _adapter(
    cfg: Config, pipeline: str, inputs: _Inputs, name: str, register: Register, data: RegisterData
) -> Path:
    """The register's adapter in its own nested MLflow run: reused when an intact one exists,
    else trained and published."""
    fp, out = _adapter_dir(cfg, inputs.base_dir, inputs.base, inputs.datasets, name)
    with tracking.stage_run(cfg, pipeline, f"lora {name}") as run_id:
        _log_inputs(inputs, cfg.corpus.name)
        existing = intact_manifest(out)
        if existing:
            log.info("adapter %s is up to date at %s; not retraining", name, out)
        else:
            _train_and_publish(cfg, inputs, name, register, data, fp, out, run_id)
        if run_id:
            mlflow.log_params({"register": name, **{f"traits.{k}": v for k, v in register.traits.items()}})
            mlflow.set_tags({"adapter_dir": str(out), "reused": str(bool(existing))})
    return out


def _adapter_dir(
    cfg: Config, base_dir: Path, base: dict[str, str], datasets: dict[str, str], name: str
) -> tuple[str, Path]:
    """(fingerprint, folder) of register ``name``'s adapter as this config trains it on the base."""
    fp = adapter_fingerprint(name, cfg.registers.get(name), base, datasets, cfg.lora)
    return fp, lora_path(cfg.paths.artifacts_dir(), base_dir.name, name, fp)


def configured_adapters(cfg: Config, base_dir: Path | None = None) -> dict[str, Path]:
    """The register adapters this config's LoRA settings train on ``base_dir`` (None: the base
    train_loras would use), for ``lora.registers`` (else every register), by register: the folders
    their fingerprints name, whether or not they exist yet. What a later stage run alone takes
    (publish, federate), never whichever adapter is newest."""
    artifacts = cfg.paths.artifacts_dir()
    synth = find_synth(cfg.composition, cfg.registers, cfg.teacher, cfg.curation, artifacts)
    corpus = find_corpus(cfg.corpus, artifacts)
    if base_dir is None:
        base_dir = Path(cfg.lora.base_dir) if cfg.lora.base_dir else plan(cfg, corpus, synth).out
    if not (base_dir / MANIFEST).exists():
        raise NimmerError(
            f"no published base at {base_dir}: run `python -m pipelines.build_base` with the same "
            "overrides first, or point lora.base_dir at a base folder"
        )
    datasets = {"synth": synth.fingerprint, "corpus": corpus.fingerprint}  # as _Inputs.datasets
    base = base_identity(base_dir)
    names = cfg.lora.registers if cfg.lora.registers is not None else cfg.registers.names
    return {name: _adapter_dir(cfg, base_dir, base, datasets, name)[1] for name in names}


def _train_and_publish(
    cfg: Config,
    inputs: _Inputs,
    name: str,
    register: Register,
    data: RegisterData,
    fp: str,
    out: Path,
    run_id: str | None,
) -> None:
    settings = cfg.lora
    logger = tracking.metric_logger(run_id, cfg.tracking.tracking_uri() if run_id else None)
    progress = Progress(f"train_loras {name}", settings.max_steps)
    try:
        model, metrics = train_adapter(
            name,
            data,
            inputs.base_dir,
            settings,
            cfg.model.lora_target_modules,
            work_dir(out),
            with_progress(logger, progress),
        )
    finally:
        progress.close()
    metrics.update(
        r1_examples=data.r1_examples,
        literary_examples=data.literary_examples,
        **{f"heldout_examples_{k}": len(v) for k, v in data.heldout.items()},
    )
    publish_adapter(
        model,
        out,
        fp,
        {
            "register": name,
            "traits": register.traits,
            "base": inputs.base,
            "datasets": inputs.datasets,
            "training_config_hash": fp,
            "lora": dataclasses.asdict(settings),
            "target_modules": list(cfg.model.lora_target_modules),
            "metrics": metrics,
        },
    )


def _log_evaluation(ev: Evaluation) -> None:
    """Per evaluation set and token class a CSV matrix (loss, interval, n); the headline matrix as
    an image; the flat metrics; the summary; the samples."""
    for name in EVAL_SETS:
        for cls in TOKEN_CLASSES:
            rows = ev.table(name, cls)
            if rows:
                header = list(rows[0])
                lines = [",".join(header)] + [",".join(f'"{r[h]}"' for h in header) for r in rows]
                mlflow.log_text("\n".join(lines) + "\n", f"evaluation/heldout_loss_{name}_{cls}.csv")
    _log_matrix_image(ev)
    mlflow.log_metrics(ev.metrics())
    mlflow.log_dict(ev.summary(), "evaluation/summary.json")
    if ev.samples:
        mlflow.log_table({k: [s[k] for s in ev.samples] for k in ev.samples[0]}, "evaluation/samples.json")


def _log_matrix_image(ev: Evaluation) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    head = ev.headline
    columns = [BASE, *ev.registers]
    values = [[head.matrix[r][c].loss for c in columns] for r in head.registers]
    fig, ax = plt.subplots(figsize=(1.5 + 0.9 * len(columns), 1.5 + 0.6 * len(values)))
    image = ax.imshow(values, cmap="viridis_r")
    ax.set_xticks(range(len(columns)), columns, rotation=30, ha="right")
    ax.set_yticks(range(len(values)), [f"{r} (n={head.matrix[r][BASE].n})" for r in head.registers])
    ax.set_xlabel("adapter (base = no adapter)")
    ax.set_ylabel("held-out scenes of register")
    ax.set_title(f"utterance-token loss, {HEADLINE[0]}", fontsize=9)
    for i, row in enumerate(values):
        for j, value in enumerate(row):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", color="white", fontsize=8)
    fig.colorbar(image, ax=ax, label="held-out loss (nats/token)")
    fig.tight_layout()
    mlflow.log_figure(
        fig, "evaluation/heldout_loss_matrix.png", save_kwargs={"bbox_inches": "tight", "dpi": 120}
    )
    plt.close(fig)
