"""Teacher-tier synthetic dialogue, r0 -> r1.

Expands the composition spec into requests, answers them through the durable cache and the
configured teacher, keeps every raw reply with its provenance (r0), curates (r1) and writes
``artifacts/synth/<composition>-<fingerprint>/``: ``r0/`` (HF Dataset), ``r1/`` (DatasetDict
in TRL's conversational ``messages`` format with composition-tag columns), the machine-generated
data card ``README.md``, ``stats.json`` and ``manifest.json``.

r1 is split by scene: the held-out scenes (:func:`heldout_scenes`) share no scene with ``train``.
``validation`` holds their curated replies; ``validation_unfiltered`` every reply of theirs that
is valid under the schema, before the other curation filters, so that an evaluation need not rest
on replies chosen for being separable. Every assistant turn is rendered by
:func:`~nimmer_train.voice.prompt_dsl.render_reply`, the format the runtime grammar accepts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict

from nimmer_train.artifacts import (
    README,
    atomic_dir,
    fingerprint,
    intact_manifest,
    sha256_file,
    source_fingerprint,
    synth_path,
    write_json_atomic,
    write_manifest,
)
from nimmer_train.config import CurationConfig, TeacherConfig
from nimmer_train.corpus import data_card
from nimmer_train.errors import NimmerError
from nimmer_train.synth.curation import curate, register_accuracy, rejection_counts
from nimmer_train.synth.teacher import ResponseCache, make_teacher, run_requests
from nimmer_train.synth.teacher.checkpoint import resolve_teacher
from nimmer_train.voice.composition import CompositionConfig, GenerationRequest, expand
from nimmer_train.voice.prompt_dsl import render_compact, render_reply
from nimmer_train.voice.registers import RegistersConfig, teachers_view

log = logging.getLogger(__name__)

SYNTH_VERSION = 1
SAMPLES = "samples.json"  # three kept turns per register, for the data card and MLflow
VALIDATION = "validation"  # r1 split: curated replies of the held-out scenes
VALIDATION_UNFILTERED = "validation_unfiltered"  # r1 split: their schema-valid replies before curation
_NOT_SEMANTIC = (
    "concurrency",
    "timeout_s",
    "max_retries",
    "max_failure_share",
    "backoff_base_s",
    "backoff_max_s",
    "batch_size",
    "cache",
    "price_in_per_mtok",
    "price_out_per_mtok",
    "api_key_env",
)


@dataclass(frozen=True)
class SynthResult:
    path: Path
    fingerprint: str
    stats: dict[str, Any]
    reused: bool
    samples: list[dict[str, Any]]


def synth_fingerprint(
    spec: CompositionConfig, catalogue: RegistersConfig, teacher: TeacherConfig, curation: CurationConfig
) -> str:
    teacher_settings = {k: v for k, v in dataclasses.asdict(teacher).items() if k not in _NOT_SEMANTIC}
    if teacher.backend == "replay" and Path(str(teacher.replay_file)).is_file():
        teacher_settings["replay_sha256"] = sha256_file(Path(str(teacher.replay_file)))
    from nimmer_train.synth import curation as curation_module
    from nimmer_train.synth.teacher import backends
    from nimmer_train.voice import composition, prompt_dsl

    code = source_fingerprint(composition, curation_module, prompt_dsl, backends, sys.modules[__name__])
    return fingerprint(
        {
            "version": SYNTH_VERSION,
            "code": code,
            "composition": dataclasses.asdict(spec),
            "registers": teachers_view(catalogue),
            "teacher": teacher_settings,
            "curation": dataclasses.asdict(curation),
        }
    )


def find_synth(
    spec: CompositionConfig,
    catalogue: RegistersConfig,
    teacher_cfg: TeacherConfig,
    curation: CurationConfig,
    artifacts: Path,
) -> SynthResult:
    """The already-built r0/r1 corpus for this config; a clear error when there is none."""
    _, out, found = _locate(spec, catalogue, teacher_cfg, curation, artifacts)
    if found is None:
        raise NimmerError(
            f"no synthetic corpus at {out}: run `python -m pipelines.synthesize` with the same "
            "overrides first"
        )
    return found


def _locate(
    spec: CompositionConfig,
    catalogue: RegistersConfig,
    teacher_cfg: TeacherConfig,
    curation: CurationConfig,
    artifacts: Path,
) -> tuple[str, Path, SynthResult | None]:
    """(fingerprint, folder, the published corpus there or None) for this config."""
    fp = synth_fingerprint(spec, catalogue, teacher_cfg, curation)
    out = synth_path(artifacts, spec.name, fp)
    manifest = intact_manifest(out)
    if manifest is None:
        return fp, out, None
    samples = json.loads((out / SAMPLES).read_text())
    return fp, out, SynthResult(out, fp, manifest["lineage"]["stats"], True, samples)


def synthesize(
    spec: CompositionConfig,
    catalogue: RegistersConfig,
    teacher_cfg: TeacherConfig,
    curation: CurationConfig,
    artifacts: Path,
) -> SynthResult:
    """Build (or find) the r0/r1 synthetic corpus for ``spec``."""
    fp, out, found = _locate(spec, catalogue, teacher_cfg, curation, artifacts)
    if found is not None:
        log.info("synthetic corpus %s is up to date at %s; nothing to do", spec.name, out)
        return found

    requests = expand(spec, catalogue)
    teacher = make_teacher(resolve_teacher(teacher_cfg, artifacts))
    cache = ResponseCache(Path(teacher_cfg.cache))
    started = time.time()
    records: list[dict[str, Any]] = []
    try:
        for request, reply, cached in run_requests(requests, teacher, cache, teacher_cfg.max_failure_share):
            records.append(_record(request, reply, cached, teacher.backend, teacher.model))
            if len(records) % 50 == 0:
                log.info("%d / %d replies", len(records), len(requests))
    finally:
        cache.close()
    order = {r.key: i for i, r in enumerate(requests)}
    records.sort(key=lambda r: order[r["key"]])
    curate(records, catalogue, curation)
    kept = [r for r in records if r["status"] == "kept"]
    stats = _stats(records, kept, teacher_cfg, teacher.model, time.time() - started)
    stats["register_accuracy"] = register_accuracy(records)
    samples = [
        {
            "register": r["register"],
            "scene": r["scene"],
            "turn_intent": r["turn_intent"],
            "player": r["player_utterance"],
            "utterance": r["utterance"],
        }
        for r in _one_per_register(kept, per=3)
    ]

    with atomic_dir(out) as staging:
        Dataset.from_list([_r0_row(r) for r in records]).save_to_disk(str(staging / "r0"))
        heldout = heldout_scenes([scene.name for scene in spec.scenes], curation.validation_fraction)
        split = {
            "train": [_r1_row(r) for r in kept if r["scene"] not in heldout],
            VALIDATION: [_r1_row(r) for r in kept if r["scene"] in heldout],
            VALIDATION_UNFILTERED: [
                {**_r1_row(r), "status": r["status"], "reason": r["reason"] or ""}
                for r in records
                if r["scene"] in heldout and r["reply"] is not None
            ],
        }
        DatasetDict({name: Dataset.from_list(part) for name, part in split.items()}).save_to_disk(
            str(staging / "r1")
        )
        stats["splits"] = {name: len(part) for name, part in split.items()}
        stats["heldout_scenes"] = sorted(heldout)
        write_json_atomic(staging / "stats.json", stats)
        write_json_atomic(staging / SAMPLES, samples)
        (staging / README).write_text(_card(spec, teacher_cfg, teacher.model, stats, samples))
        write_manifest(
            staging,
            "synth",
            fp,
            {"composition": spec.name, "stats": stats, "registers_version": catalogue.version},
        )
    log.info("synthetic corpus %s: r0 %d, r1 %d at %s", spec.name, len(records), len(kept), out)
    return SynthResult(out, fp, stats, False, samples)


def _record(request: GenerationRequest, reply: Any, cached: bool, backend: str, model: str) -> dict[str, Any]:
    return {
        "key": request.key,
        "register": request.register,
        **{k: v for k, v in request.tags.items() if k != "register"},
        "player_utterance": request.prompt.player_utterance,
        "messages": request.messages,
        "prompt": request.prompt,
        "output_schema": request.prompt.output_schema,
        "sampling": request.sampling.as_dict(),
        "backend": backend,
        "model": model,
        "content": reply.content,
        "error": reply.error,
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "latency_s": reply.latency_s,
        "dropped_knobs": list(reply.dropped_knobs),
        "cached": cached,
        "received_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _r0_row(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "request_key": rec["key"],
        "register": rec["register"],
        "jitter": rec["jitter"],
        "scene": rec["scene"],
        "turn_intent": rec["turn_intent"],
        "zone": rec["zone"],
        "request": json.dumps({"messages": rec["messages"], "sampling": rec["sampling"]}, ensure_ascii=False),
        "backend": rec["backend"],
        "model": rec["model"],
        "content": rec["content"] or "",
        "error": rec["error"] or "",
        "prompt_tokens": rec["prompt_tokens"],
        "completion_tokens": rec["completion_tokens"],
        "latency_s": rec["latency_s"],
        "cached": rec["cached"],
        "received_at": rec["received_at"],
        "status": rec["status"],
        "reason": rec["reason"] or "",
        "detail": rec["detail"],
    }


def _r1_row(rec: dict[str, Any]) -> dict[str, Any]:
    """TRL conversational format: the compact DSL render (what the LoRA model will see) plus the reply."""
    messages = render_compact(rec["prompt"])
    messages.append({"role": "assistant", "content": render_reply(rec["reply"], rec["output_schema"])})
    return {
        "messages": messages,
        "register": rec["register"],
        "jitter": rec["jitter"],
        "scene": rec["scene"],
        "turn_intent": rec["turn_intent"],
        "zone": rec["zone"],
        "trait_vector": json.dumps(rec["prompt"].trait_vector),
        "request_key": rec["key"],
        "backend": rec["backend"],
        "model": rec["model"],
    }


def heldout_scenes(scenes: list[str], fraction: float) -> set[str]:
    """The scenes held out from training: ceil(fraction x scenes) of them, at least one and never
    all (none when fraction is 0), ranked by a hash of the name (independent of the list order)."""
    if fraction <= 0 or len(scenes) < 2:
        return set()
    n = min(len(scenes) - 1, max(1, math.ceil(fraction * len(scenes))))
    return set(sorted(scenes, key=lambda name: hashlib.sha256(name.encode()).hexdigest())[:n])


def _one_per_register(rows: list[dict[str, Any]], per: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in dict.fromkeys(r["register"] for r in rows):
        out += [r for r in rows if r["register"] == name][:per]
    return out


def _stats(records: list[dict], kept: list[dict], cfg: TeacherConfig, model: str, wall_s: float) -> dict:
    prompt = sum(r["prompt_tokens"] for r in records)
    completion = sum(r["completion_tokens"] for r in records)
    fresh = [r for r in records if not r["cached"]]
    fresh_prompt = sum(r["prompt_tokens"] for r in fresh)
    fresh_completion = sum(r["completion_tokens"] for r in fresh)
    per_register = {}
    for name in dict.fromkeys(r["register"] for r in records):
        mine = [r for r in records if r["register"] == name]
        per_register[name] = {"r0": len(mine), "r1": sum(r["status"] == "kept" for r in mine)}
    return {
        "backend": cfg.backend,
        "model": model,
        "r0": len(records),
        "r1": len(kept),
        "requested": len(fresh),
        "cached": len(records) - len(fresh),
        "rejections": rejection_counts(records),
        "per_register": per_register,
        "tokens": {"prompt": prompt, "completion": completion},
        "cost_usd": {
            "this_run": (fresh_prompt * cfg.price_in_per_mtok + fresh_completion * cfg.price_out_per_mtok)
            / 1e6,
            "corpus_total": (prompt * cfg.price_in_per_mtok + completion * cfg.price_out_per_mtok) / 1e6,
        },
        "dropped_knobs": sorted({k for r in records for k in r["dropped_knobs"]}),
        "wall_s": wall_s,
        "completion_tokens_per_s": fresh_completion / wall_s if fresh and wall_s > 0 else None,
    }


def _card(spec: CompositionConfig, cfg: TeacherConfig, model: str, stats: dict, samples: list[dict]) -> str:
    reasons = [{"reason": k, "rejected": v} for k, v in sorted(stats["rejections"].items())]
    provenance = cfg.provenance or f"generated by the {cfg.backend} teacher backend, model {model}"
    body = f"""
# nimmerworld synthetic register dialogue: {spec.name}

Curated teacher-tier dialogue for training register trait-LoRAs, from the teacher backend
**{cfg.backend}**, model **{model}**.

**Provenance: {provenance}.**

## Motivation

Register trait-LoRAs need conversations in each register's voice, tagged with the composition
(register, trait jitter, scene, turn intent, zone) they were written for.

## Composition

Rows are TRL conversational `messages`: a system message holding the turn's prompt DSL as
compact JSON (what a LoRA-carrying model sees at run time), the player's line, and the NPC's
reply as JSON matching the turn's output schema.

{data_card.table([{"register": k, "r0": v["r0"], "r1": v["r1"]} for k, v in stats["per_register"].items()])}

The split is by scene: the held-out scenes ({", ".join(stats["heldout_scenes"]) or "none"}) appear in
no training row. `validation` holds their curated replies and `validation_unfiltered` every reply
of theirs that is valid under the schema, before the other curation filters.

{data_card.table([{"split": k, "rows": v} for k, v in stats["splits"].items()])}

## Collection process

Requests from the composition spec `{spec.name}` were answered by the teacher through a durable
response cache. r0 keeps every raw reply with its provenance; r1 keeps those that pass curation.

{
        data_card.table(
            [
                {
                    "r0": stats["r0"],
                    "r1": stats["r1"],
                    "requested this run": stats["requested"],
                    "from cache": stats["cached"],
                    "prompt tokens": stats["tokens"]["prompt"],
                    "completion tokens": stats["tokens"]["completion"],
                    "cost (USD)": f"{stats['cost_usd']['corpus_total']:.4f}",
                }
            ]
        )
    }

## Preprocessing

Curation checks JSON-schema validity, length, language, prompt leakage, register consistency
(nearest register centroid of the catalogue's exemplars in character 1-3-gram TF-IDF space;
share of scored replies placed in their own register:
{
        stats["register_accuracy"]
        if stats["register_accuracy"] is None
        else f"{stats['register_accuracy']:.3f}"
    }) and near duplicates.
Rejections by reason:

{data_card.table(reasons)}

## Uses

Supervised fine-tuning of register LoRAs and their evaluation. Not a record of real people.

## Distribution

Generated for the nimmerworld project; see the teacher's terms for machine-generated text.

## Maintenance

Regenerate with `python -m pipelines.synthesize`; the fingerprint of spec, catalogue, teacher and
curation names each version.

## Samples

{data_card.table([{k: s[k] for k in ("register", "turn_intent", "utterance")} for s in samples])}
"""
    metadata = {
        "pretty_name": f"nimmerworld synthetic dialogue ({spec.name})",
        "license": "other",
        "language": ["en"],
        "task_categories": ["text-generation"],
        "source_datasets": ["original"],
        "annotations_creators": ["machine-generated"],
        "language_creators": ["machine-generated" if not cfg.provenance else "expert-generated"],
        "size_categories": [data_card.size_category(stats["r1"])],
    }
    return "---\n" + data_card.yaml.safe_dump(metadata, sort_keys=False) + "---\n" + body
