"""Every stage in data-flow order under one MLflow parent run.

The stage contract, which every ``nimmer_train/<package>/stage.py`` honours:

- **Signature.** ``<verb>_stage(cfg, <results of earlier stages, all optional>, pipeline=...)``
  returns a result dataclass. Run alone (``python -m pipelines.<stage>``), a stage finds its
  inputs by fingerprint under ``paths.artifacts`` (the corpus, the base, the LoRAs a config
  implies), and builds a missing upstream input where that is cheap (ingest) or says which
  pipeline to run first.
- **Tracking.** It opens one MLflow run (``tracking.stage_run``): nested under run_all's parent
  run when chained, in the experiment ``<prefix>-<pipeline>`` when run alone. Params, lineage
  (input datasets with their fingerprints), metrics and the manifest are logged there.
- **Output.** It publishes one folder named by a fingerprint of its inputs and config, staged
  elsewhere, fsynced and renamed into place with a ``manifest.json`` of sha256 sums
  (``artifacts.atomic_folder``): a folder that exists is complete.
- **Idempotence and resumption.** A re-run with nothing changed finds that folder and does no
  work (``reused``); a killed run resumes from its checkpoints (base, LoRAs, federation rounds)
  or its durable cache (teacher replies), and continues the same MLflow run where it kept one.

Two stages differ by nature and say so: ``publish`` allocates the next version label in the
registry (publishing the same inputs again returns the existing version), and ``speak`` is
inference: it writes ``runtime/turns.json`` atomically each time it runs. The demo composes its
other sessions on the spoken version (mood, voice report, agent memory, dreams) around the speak
stage (``runtime/demo_sessions.speak_demo``), in its MLflow run.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nimmer_train import tracking
from nimmer_train.artifacts import FRESH_START, MANIFEST, write_json_atomic
from nimmer_train.base.build import BaseResult
from nimmer_train.base.stage import build_base_stage
from nimmer_train.config import Config
from nimmer_train.corpus.ingest import IngestResult
from nimmer_train.corpus.stage import ingest_stage
from nimmer_train.errors import NimmerError
from nimmer_train.progress import stage_watch
from nimmer_train.publish.listing import print_versions
from nimmer_train.synth.stage import synthesize_stage
from nimmer_train.synth.synthesize import SynthResult
from nimmer_train.voice.quality import bar_checks

if TYPE_CHECKING:  # the later stages' imports (peft, trl, flwr) load only when run_all needs them
    from nimmer_train.federation.stage import FederationResult
    from nimmer_train.loras.stage import LoraResult
    from nimmer_train.publish.stage import PublishResult
    from nimmer_train.runtime.stage import SpeakResult


@dataclass
class RunAllResult:
    """What one run_all produced, stage by stage (None: the stage is switched off)."""

    corpus: IngestResult
    synth: SynthResult
    base: BaseResult
    loras: LoraResult
    federation: FederationResult | None
    publish: PublishResult | None
    speak: SpeakResult | None
    seconds: dict[str, float] = field(default_factory=dict)  # wall seconds of each stage that ran


QUICK = "make demo EXPERIMENT=tiny"  # the scratch preset: every stage in minutes, no wheel needed
# each stage's seconds on a quiet 2-core machine, estimated (docs/config.md#experiment-presets):
# the ETAs of a first run, before any was recorded (stage_times)
FIRST_RUN: dict[str, dict[str, float]] = {
    "demo": {  # timed on a fresh clone of 857f015 (docs/config.md#experiment-presets)
        "ingest": 2,
        "synthesize": 1,
        "build_base": 108,
        "train_loras": 703,
        "federate": 211,
        "publish": 138,
        "speak": 114,
    },
}
REAL_BASE_MEMORY_GIB = 6.0  # a pretrained base (SmolLM2-135M): training, the federation's nodes, serving


def available_memory_gib() -> float | None:
    """Memory the kernel says a new process can use (MemAvailable), None where it does not say."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def preflight(cfg: Config, memory_gib: float | None = None) -> None:
    """Before any work: a base from a wheel's GGUF needs the wheel and the memory to train it; a
    machine without either gets one line that names the quick preset."""
    if not cfg.model.gguf_package or not cfg.model.gguf_file:
        return
    from nimmer_train.base.from_gguf import locate

    try:
        locate(cfg.model.gguf_package, cfg.model.gguf_file)
    except NimmerError as exc:
        raise NimmerError(f"{exc}; or run the quick preset on a scratch model: {QUICK}") from None
    memory_gib = available_memory_gib() if memory_gib is None else memory_gib
    if memory_gib is not None and memory_gib < REAL_BASE_MEMORY_GIB:
        raise NimmerError(
            f"model={cfg.model.name} needs about {REAL_BASE_MEMORY_GIB:g} GiB of free memory, this "
            f"machine has {memory_gib:.1f} GiB available; free some, or run the quick preset on a "
            f"scratch model: {QUICK}"
        )


def run_all(cfg: Config) -> RunAllResult:
    """Every stage in order, each a nested run under one parent run in experiment run_all."""
    preflight(cfg)
    # heavy (peft, trl, flwr, the runtime's engine): loaded when run_all runs, not on import
    from nimmer_train.federation.stage import federate_stage
    from nimmer_train.loras.stage import train_loras_stage
    from nimmer_train.publish.stage import publish_stage
    from nimmer_train.runtime.demo_sessions import speak_demo
    from nimmer_train.runtime.voice_eval import candidate_report

    speak, seconds = None, {}
    stages = _stages(cfg)
    before = stage_times(cfg)

    def timed(name: str, stage: Callable[[], Any]) -> Any:
        started, rest = time.perf_counter(), stages[stages.index(name) + 1 :]
        after = sum(before[n] for n in rest) if all(n in before for n in rest) else None
        label = f"run_all {name} ({stages.index(name) + 1}/{len(stages)})"
        try:
            with watched(cfg, name, label, after):
                return stage()
        finally:
            seconds[name] = time.perf_counter() - started

    with tracking.stage_run(cfg, "run_all", "run_all"):
        corpus = timed("ingest", lambda: ingest_stage(cfg, pipeline="run_all"))
        synth = timed("synthesize", lambda: synthesize_stage(cfg, pipeline="run_all"))
        base = timed("build_base", lambda: build_base_stage(cfg, corpus, synth, pipeline="run_all"))
        loras = timed(
            "train_loras", lambda: train_loras_stage(cfg, corpus, synth, base.path, pipeline="run_all")
        )
        federation = (
            timed("federate", lambda: federate_stage(cfg, loras, pipeline="run_all"))
            if cfg.federated.enabled
            else None
        )
        published = (
            timed(
                "publish",
                lambda: publish_stage(
                    cfg, base.path, loras, federation, pipeline="run_all", voice=candidate_report
                ),
            )
            if cfg.publish.enabled
            else None
        )
        if published and published.versions and cfg.runtime.enabled:  # speak through what was published
            speak = timed("speak", lambda: speak_demo(cfg, pipeline="run_all"))
    return RunAllResult(corpus, synth, base, loras, federation, published, speak, seconds)


def _stages(cfg: Config) -> list[str]:
    """The stages run_all will run for ``cfg``, in order."""
    stages = ["ingest", "synthesize", "build_base", "train_loras"]
    stages += ["federate"] if cfg.federated.enabled else []
    stages += ["publish"] if cfg.publish.enabled else []
    return stages + (["speak"] if cfg.publish.enabled and cfg.runtime.enabled else [])


TIMES = "run_all_seconds.json"  # in paths.artifacts: what each stage took when it last did work


def stage_times(cfg: Config) -> dict[str, float]:
    """What each stage of this experiment took the last time it did work (over 10 s: a stage that
    found its output takes less), which the progress lines' ETAs are estimated from; the demo's
    first run on a quiet 2-core machine as timed in docs/config.md#experiment-presets where
    none was recorded."""
    try:
        recorded = json.loads((cfg.paths.artifacts_dir() / TIMES).read_text()).get(cfg.experiment_name, {})
    except (OSError, ValueError):
        recorded = {}
    return {**FIRST_RUN.get(cfg.experiment_name, {}), **recorded}


@contextlib.contextmanager
def watched(cfg: Config, stage: str, label: str | None = None, after: float | None = None) -> Iterator[None]:
    """Progress lines with an ETA while ``stage`` runs (:func:`~nimmer_train.progress.stage_watch`
    from :func:`stage_times`; ``after``: what the stages after it take), and its time recorded
    when it ends without an error (run_all's stages, and each pipeline run alone)."""
    started = time.perf_counter()
    with stage_watch(label or stage, stage_times(cfg).get(stage), after):
        yield
    _record_time(cfg, stage, time.perf_counter() - started)


def _record_time(cfg: Config, stage: str, seconds: float) -> None:
    if seconds <= 10:
        return
    path = cfg.paths.artifacts_dir() / TIMES
    try:
        times = json.loads(path.read_text())
    except (OSError, ValueError):
        times = {}
    times.setdefault(cfg.experiment_name, {})[stage] = round(seconds, 1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, times)
    except OSError:  # only the next run's ETAs depend on it: never fail a stage that did its work
        pass


def _duration(seconds: float) -> str:
    return f"{int(seconds) // 60}m{int(seconds) % 60:02d}s" if seconds >= 60 else f"{seconds:.0f}s"


def voice_line(label: str, folder: Path) -> str | None:
    """One line of a version's voice report (its manifest's): the overall figures and the weakest
    register's accuracy; None when it has none."""
    try:
        report = json.loads((folder / MANIFEST).read_text()).get("voice_report") or {}
    except (OSError, ValueError):
        return None
    overall, rows = report.get("overall") or {}, report.get("registers") or []
    if not overall:
        return None

    def figure(row: dict[str, Any], key: str) -> str:
        value = row.get(key)
        return "n/a" if value is None else f"{value:.2f}"

    known = [r for r in rows if r.get("register_accuracy") is not None]
    weakest = min(known, key=lambda r: r["register_accuracy"]) if known else None
    tail = f", weakest {weakest['register']} {weakest['register_accuracy']:.2f}" if weakest else ""
    missed = [c["goal"] for c in bar_checks(report) if not c["passed"]] if rows else []
    verdict = "; bar met" if rows and not missed else f"; bar FAILS: {', '.join(missed)}" if rows else ""
    return (
        f"{label} voices: schema-valid {figure(overall, 'schema_valid')}, English "
        f"{figure(overall, 'english_rate')}, register accuracy {figure(overall, 'register_accuracy')}"
        f"{tail}, distinct-2 {figure(overall, 'distinct_2')} ({overall.get('turns', '?')} turns){verdict}"
    )


def federation_line(metadata: dict[str, Any]) -> str | None:
    """The federated adapter's held-out gain over its start adapter, with its interval and the
    A.1 epsilon it was bought at; None when the federation measured no gain."""
    fed = metadata.get("federation") or {}
    g = fed.get("heldout_gain")
    if not g:
        return None
    eps = fed.get("epsilon_a1_user_level")
    at = "no privacy" if fed.get("no_privacy") else f"A.1 epsilon {eps:.2f} at delta {fed.get('delta'):g}"
    said = " (no gain at this epsilon)" if g["gain"] <= 0 or g["low"] <= 0 else ""
    start = "the base (a fresh adapter)" if metadata.get(FRESH_START) else "its start adapter"
    return (
        f"federated {metadata.get('register', 'adapter')} gain {g['gain']:+.3f} nats/token "
        f"[{g['low']:+.3f}, {g['high']:+.3f}] over {start}, {at}{said}"
    )


def print_summary(cfg: Config, result: RunAllResult) -> None:
    """What run_all produced, the published versions and how to review the runs."""
    versions = result.publish.versions if result.publish else []
    print("\nProduced:")
    print(f"  corpus dataset + data card  {result.corpus.path}")
    print(f"  synthetic r0/r1 + data card {result.synth.path}")
    print(f"  base model (HF folder)      {result.base.path}")
    print(f"  register LoRAs (PEFT)       {result.loras.root}")
    if result.federation:
        print(f"  federated adapter (PEFT)    {result.federation.adapter}")
    for version in versions:
        print(f"  {version.label:<27} {version.folder}")
    if result.loras.evaluation:
        ev = result.loras.evaluation
        sep, gain = ev.headline.separability, ev.headline.mean_gain
        print(
            f"  register separability {sep.value:.2f} [{sep.low:.2f}, {sep.high:.2f}], mean held-out "
            f"loss gain {gain.value:.3f} [{gain.low:.3f}, {gain.high:.3f}] (utterance tokens)"
        )
    for version in versions:
        line = voice_line(version.label, version.folder)
        if line:
            print(f"  {line}")
    fed_line = federation_line(result.federation.metadata) if result.federation else None
    if fed_line:
        print(f"  {fed_line}")
    if result.seconds:
        stages = ", ".join(f"{name} {_duration(s)}" for name, s in result.seconds.items())
        print(f"  stage times: {stages}; total {_duration(sum(result.seconds.values()))}")
    if versions:
        print(f"\n$ nimmer versions --releases {cfg.publish.releases_dir} list")
        print_versions(Path(cfg.publish.releases_dir))
    if cfg.tracking.enabled:
        print(f"\nReview the runs:\n  {tracking.ui_command(cfg.tracking)}")
    if cfg.model.tokenizer != "pretrained":  # a base trained from scratch here: fragments, not speech
        print(
            f"\nThese voices come from a {cfg.model.name} base trained from scratch in minutes, so the"
            " turns above are fragments. For NPCs that speak English, the same pipeline on a real"
            " pretrained base (SmolLM2-135M from its wheel): the default,\n"
            "  make demo"
        )
