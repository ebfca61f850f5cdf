"""The demo's voice report at 32 turns per register (issue 38): the same report the model card
carries at 8, on the versions `make demo` published, so that its figures have usable intervals.

Each version in the demo's registry (``releases/`` beside this repository, as `make demo` leaves
it) is opened through Ring A (:class:`~nimmer_train.runtime.local_model.LocalModel`, the engine in
bfloat16 where the CPU multiplies it natively, as the demo's publish measures it) and measured by
:func:`nimmer_train.runtime.voice_eval.voice_eval` on the held-out scenes its manifest records,
with 32 prompts per register (a seeded draw; the seed, token budget and scenes as the card's:
the two held out of the adapters' training sets and the six eval-only ones, four turns each).
Headline: each figure over its goal (the report's bar, :func:`nimmer_train.voice.quality.bar_checks`:
schema-valid 0.98, English 0.95, register accuracy 0.80 overall and 0.60 for the weakest register,
distinct-2 0.45 for the weakest register), >= 1 meets it, and the share of the bar's goals met.
Every figure comes with its 95 % interval of a cluster bootstrap over the scenes (``intervals`` of
each row; ``interval_scenes`` names them), and the bar with pass / fail per goal.

Without the demo's releases (run `make demo` first), and in smoke mode, the same code measures a
tiny version built from config (figures named ``tiny_*``, never compared with the demo's).

    python -m benchmarks.bench_voice32 [--smoke]
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

GOAL = (
    "each figure over its goal >= 1 on every version (the voice report's bar: schema-valid 0.98, "
    "English 0.95, register accuracy 0.80 overall and 0.60 for the weakest register, distinct-2 0.45 "
    "for the weakest register, no reply repeating a sentence more than twice): bar_met_ratio 1"
)


def recorded_report(model: Any, turns: int, tokens: int | None) -> dict[str, Any]:
    """``model``'s voice report (summary) as its card's was measured (the held-out scenes, seed
    and token budget its manifest records), at ``turns`` prompts per register (``tokens``: another
    budget)."""
    from nimmer_train.runtime.voice_eval import (
        heldout_of_config,
        recorded_heldout,
        recorded_settings,
        voice_eval,
    )
    from tests.helpers.compose import config

    cfg = config("experiment=demo")
    manifest = model.version.manifest
    settings = dataclasses.replace(
        recorded_settings(cfg.publish.voice_eval, manifest), turns_per_register=turns
    )
    if tokens:
        settings = dataclasses.replace(settings, max_new_tokens=tokens)
    heldout = recorded_heldout(manifest) or heldout_of_config(
        cfg.composition, cfg.curation.validation_fraction
    )
    return voice_eval(model, settings, cfg.registers, cfg.composition, heldout).summary()


def _measure(releases: Path, trusted: Path, turns: int, tokens: int) -> dict[str, Any]:
    from nimmer_train.publish.registry import Registry
    from nimmer_train.runtime.local_model import EngineSettings, LocalModel

    registry = Registry.open(releases)
    try:
        labels = [v.label for v in registry.versions()]
    finally:
        registry.close()
    out: dict[str, Any] = {}
    for label in labels:
        model = LocalModel.open(releases, label, trusted, settings=EngineSettings(dtype="auto"))
        try:
            out[label] = recorded_report(model, turns, tokens)
        finally:
            model.close()
    return out


def _ratios(reports: dict[str, Any], prefix: str) -> dict[str, float]:
    from nimmer_train.voice.quality import EACH_REGISTER, GOALS, bar_checks

    ratios: dict[str, float] = {}
    for label, report in reports.items():
        short = label.rsplit("-", 1)[-1]
        overall, rows = report["overall"], report["registers"]
        for key, goal in GOALS.items():
            if overall.get(key) is not None:
                ratios[f"{prefix}{short}_{key}_over_goal_ratio"] = round(overall[key] / goal, 3)
        for key, goal in EACH_REGISTER.items():
            values = [r[key] for r in rows if r.get(key) is not None]
            if values:
                ratios[f"{prefix}{short}_weakest_{key}_over_goal_ratio"] = round(min(values) / goal, 3)
        checks = bar_checks(report)
        ratios[f"{prefix}{short}_bar_met_ratio"] = round(sum(c["passed"] for c in checks) / len(checks), 3)
    return ratios


def _tiny(root: Path, turns: int) -> dict[str, Any]:
    from nimmer_train.config import ModelConfig
    from tests.helpers.published import REGISTERS, publish_registers

    tiny = ModelConfig(name="tiny", max_position_embeddings=1024)
    releases, trusted = publish_registers(root / "pub", REGISTERS[:2], tiny)
    return _measure(releases, trusted, turns, 8)


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    from benchmarks.harness import REPO

    load_before = os.getloadavg()[0]
    releases, trusted = REPO / "releases", REPO / "keys" / "trusted"
    with tempfile.TemporaryDirectory() as tmp:
        if not smoke and (releases / "registry.sqlite").exists():
            reports, prefix, model = _measure(releases, trusted, 32, 0), "", "the demo's versions"
        else:
            reports, prefix = _tiny(Path(tmp), 1 if smoke else 4), "tiny_"
            model = "tiny (smoke)" if smoke else "tiny (no demo releases: run `make demo` first)"
    from nimmer_train.voice.quality import bar_checks, report_lines

    figures: dict[str, Any] = {}
    for label, report in reports.items():
        print("\n".join(report_lines(report)))
        figures[label] = {
            "overall": report["overall"],
            "registers": {r["register"]: r for r in report["registers"]},
            "heldout_scenes": report["settings"].get("heldout_scenes"),
            "eval_only_scenes": report["settings"].get("eval_only_scenes"),
            "interval_scenes": report.get("interval_scenes"),
            "turns_per_register": report["settings"].get("turns_per_register"),
            "bar": [{k: c[k] for k in ("goal", "target", "shown", "passed")} for c in bar_checks(report)],
        }
    return {
        **_ratios(reports, prefix),
        "voice": figures,
        "goal": GOAL,
        "model": model,
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
