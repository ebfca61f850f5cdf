"""Voice parity of the quantized Ring A (issue 39, item 3): the same published version spoken
through llama.cpp on its Q8_0 and Q4_1 GGUF files and through the float32 torch engine.

Two measurements on `make demo`'s production version (``releases/`` beside this repository;
``NIMMER_PARITY_VERSION`` names another), each engine in turn in one process:

- **the voice report** (:func:`nimmer_train.runtime.voice_eval.voice_eval`, the model card's
  report: the version's recorded held-out scenes, seed and token budget) at ``turns`` prompts per
  register: register accuracy (goal: within 0.05 of float32's), English (within 0.02),
  schema-valid (1.00 on every engine). The same seeded prompts on each engine; the draws differ
  because the logits do, so a difference carries the report's own sampling noise (its scene
  intervals are printed with it).
- **the held-out utterance-token loss of each register LoRA** (goal: within 3 % of float32's):
  the r1 conversations held out of that LoRA's training set (its recorded data and recipe,
  :func:`nimmer_train.publish.rebase.recipe`, so `make demo`'s ``artifacts/`` must be there),
  teacher-forced, the mean loss over utterance tokens as the LoRAs' held-out matrix scores them
  (:func:`nimmer_train.loras.evaluation.token_classes`); float32 through PEFT on the version's
  weights, quantized through :meth:`LlamaContext.token_losses` on the version's GGUF files.

The default quant of ``runtime.engine=llama`` should be the smaller one that holds parity.

Smoke: a tiny version published here (LoRAs of random weights, no recorded training data), one
turn per register, the loss on each register's rendered turn prompt instead of held-out data.

    python -m benchmarks.bench_voice_parity [--smoke]
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np

GOAL = (
    "quantized over float32 on one published version: register accuracy within 0.05, English within "
    "0.02, schema-valid 1.00, each register LoRA's held-out utterance loss within 3 % "
    "(loss ratio 0.97 to 1.03)"
)
QUANTS = ("q8_0", "q4_1")
VERSION_ENV = "NIMMER_PARITY_VERSION"
TURNS_ENV = "NIMMER_PARITY_TURNS"  # prompts per register in the voice report (default 16)
LOSS_EXAMPLES = 4  # held-out conversations per register for the loss (a few hundred tokens each)


def _open(releases: Path, label: str, trusted: Path, engine: str) -> Any:
    from nimmer_train.runtime.local_model import EngineSettings, LocalModel
    from nimmer_train.runtime.quantized_model import QuantizedModel

    if engine == "float32":
        return LocalModel.open(releases, label, trusted, settings=EngineSettings(dtype="float32"))
    return QuantizedModel.open(releases, label, trusted, engine)


def _heldout_rows(version: Any, releases: Path, artifacts: Path, tokenizer: Any) -> dict[str, list[dict]]:
    """register -> its LoRA's held-out r1 conversations, encoded with token classes."""
    from nimmer_train.loras.evaluation import token_classes
    from nimmer_train.publish.rebase import recipe
    from tests.helpers.compose import config

    catalogue, rows = config("experiment=demo").registers, {}
    for register, folder in sorted(version.loras.items()):
        row = {"path": str(Path(folder).resolve().relative_to(releases.resolve())), "register": register}
        found = recipe(row, releases, artifacts, catalogue)
        if isinstance(found, str):
            raise RuntimeError(f"{register}: no held-out data for the loss: {found}")
        convs = found.data.heldout["r1"][:LOSS_EXAMPLES]
        rows[register] = [token_classes(tokenizer, c, found.settings.max_length) for c in convs]
    return rows


def _prompt_rows(model: Any) -> dict[str, list[dict]]:
    """Smoke: each register's rendered turn prompt, every token scored as utterance."""
    from nimmer_train.voice.prompt_dsl import AffectState, MemoryScope, TurnPrompt, render_compact
    from nimmer_train.voice.registers import load_catalogue

    rows = {}
    for register in model.registers:
        spec = load_catalogue().get(register)
        prompt = TurnPrompt(
            role=spec.role,
            trait_vector=spec.traits,
            affect_state=AffectState("watchful", valence=0.0, arousal=0.5),
            memory_scope=MemoryScope(),
            turn_intent="answer the player",
            zone_context="the water gate at dusk",
            player_utterance="What news from the gate tonight?",
        )
        ids = model.prompt_ids(render_compact(prompt))
        rows[register] = [{"input_ids": ids, "labels": ids, "classes": [-1] + [0] * (len(ids) - 1)}]
    return rows


def _mean(pairs: list[tuple[float, int]]) -> float:
    return float(sum(s for s, _ in pairs) / max(1, sum(n for _, n in pairs)))


def _float32_losses(version: Any, rows: dict[str, list[dict]], tokenizer: Any) -> dict[str, float]:
    from peft import PeftModel

    from nimmer_train.loras.adapters import load_base
    from nimmer_train.loras.evaluation import _class_sums, _losses

    names = sorted(rows)
    model = PeftModel.from_pretrained(
        load_base(version.folder), version.loras[names[0]], adapter_name=names[0]
    )
    for name in names[1:]:
        model.load_adapter(version.loras[name], adapter_name=name, is_trainable=False)
    model.eval()
    out = {}
    for name in names:
        pairs = []
        for losses, row in zip(_losses(model, name, rows[name], tokenizer), rows[name], strict=True):
            sums, counts = _class_sums(losses, row["classes"])
            pairs.append((float(sums[0]), int(counts[0])))
        out[name] = _mean(pairs)
    return out


def _quantized_losses(model: Any, rows: dict[str, list[dict]]) -> dict[str, float]:
    from nimmer_train.loras.evaluation import _class_sums

    out = {}
    for name, batch in sorted(rows.items()):
        pairs = []
        for row in batch:
            losses = model.context.token_losses(row["input_ids"], name)
            losses[np.array(row["labels"]) == -100] = np.nan
            sums, counts = _class_sums(losses, row["classes"])
            pairs.append((float(sums[0]), int(counts[0])))
        out[name] = _mean(pairs)
    return out


def _tiny(root: Path) -> tuple[Path, Path, str]:
    from nimmer_train.config import ModelConfig
    from tests.helpers.published import REGISTERS, publish_registers

    tiny = ModelConfig(name="tiny", max_position_embeddings=1024)
    releases, trusted = publish_registers(root / "pub", REGISTERS[:2], tiny)
    return releases, trusted, "v1"


def _compare(voice: dict[str, Any], losses: dict[str, dict[str, float]]) -> dict[str, Any]:
    ratios: dict[str, Any] = {}
    ref, ref_loss = voice["float32"]["overall"], losses["float32"]
    for quant in QUANTS:
        got = voice[quant]["overall"]
        for key in ("register_accuracy", "english_rate"):
            if got.get(key) is not None and ref.get(key) is not None:
                ratios[f"{quant}_{key}_minus_float32"] = round(got[key] - ref[key], 3)
        ratios[f"{quant}_schema_valid"] = got.get("schema_valid")
        per = {r: losses[quant][r] / ref_loss[r] for r in ref_loss if ref_loss[r] > 0}
        ratios[f"{quant}_heldout_loss_over_float32_ratio"] = round(float(np.mean(list(per.values()))), 4)
        ratios[f"{quant}_heldout_loss_worst_register_ratio"] = round(
            max(per.values(), key=lambda v: abs(v - 1)), 4
        )
        ratios[f"{quant}_holds_parity"] = bool(
            abs(ratios.get(f"{quant}_register_accuracy_minus_float32", 1)) <= 0.05
            and abs(ratios.get(f"{quant}_english_rate_minus_float32", 1)) <= 0.02
            and got.get("schema_valid") == 1.0
            and all(abs(v - 1) <= 0.03 for v in per.values())
        )
    return ratios


def run(smoke: bool = False) -> dict[str, object]:
    warnings.filterwarnings("ignore")
    from transformers import AutoTokenizer

    from benchmarks.bench_voice32 import recorded_report
    from benchmarks.harness import REPO
    from nimmer_train.voice.quality import report_lines

    load_before = os.getloadavg()[0]
    turns = 1 if smoke else int(os.environ.get(TURNS_ENV, "16"))
    with tempfile.TemporaryDirectory() as tmp:
        releases, trusted, label = (
            REPO / "releases",
            REPO / "keys" / "trusted",
            os.environ.get(VERSION_ENV, "production"),
        )
        real = not smoke and (releases / "registry.sqlite").exists()
        if not real:
            releases, trusted, label = _tiny(Path(tmp))
        voice: dict[str, Any] = {}
        losses: dict[str, dict[str, float]] = {}
        rows: dict[str, list[dict]] | None = None
        for engine in ("float32", *QUANTS):
            model = _open(releases, label, trusted, engine)
            try:
                if rows is None:
                    tokenizer = AutoTokenizer.from_pretrained(model.version.folder)
                    rows = (
                        _heldout_rows(model.version, releases, REPO / "artifacts", tokenizer)
                        if real
                        else _prompt_rows(model)
                    )
                    losses["float32"] = _float32_losses(model.version, rows, tokenizer)
                else:
                    losses[engine] = _quantized_losses(model, rows)
                voice[engine] = recorded_report(model, turns, None if real else 24)
                label = model.label
            finally:
                model.close()
            print("\n".join(report_lines(voice[engine])))
    return {
        **_compare(voice, losses),
        "version": label,
        "model": "the demo's production version" if real else "tiny (smoke or no demo releases)",
        "turns_per_register": turns,
        "loss_examples_per_register": LOSS_EXAMPLES if real else 1,
        "heldout_utterance_loss": losses,
        "voice": {e: {"overall": v["overall"], "registers": v["registers"]} for e, v in voice.items()},
        "goal": GOAL,
        "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


if __name__ == "__main__":
    from benchmarks.harness import main

    main(run)
