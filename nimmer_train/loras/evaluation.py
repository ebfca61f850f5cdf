"""The register evaluation: held-out losses of the bare base and of every adapter on every
register's held-out conversations, split by token class, with bootstrap intervals.

Token classes of a reply in the training format (:func:`~nimmer_train.voice.prompt_dsl.render_reply`):

- ``utterance``: the tokens with a character inside the utterance string: the voice;
- ``fields``: those inside the other property values (emotion, gesture);
- ``format``: the rest: keys, quotes, separators, braces and the end-of-turn token.

Separability and mean gain are computed on utterance tokens; the format and fields figures are
reported beside them (most of an adapter's gain over the bare base is learning the format, which
every adapter learns alike). Evaluation sets, both from scenes no adapter was trained on:

- ``r1``: the curated replies (the r1 ``validation`` split);
- ``r0``: every schema-valid teacher reply, before the curation filters (length, language,
  leakage, stylometric register consistency, near duplicates): the register check keeps only
  replies a classifier already finds separable, so ``r1`` alone would flatter separability.

Every cell carries its n (conversations and tokens) and a 95% percentile-bootstrap interval over
conversations; separability, mean gain and each register's margin (best rival adapter's loss
minus its own) are bootstrapped with the same resamples.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nimmer_train.config import LoraConfig
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import load_all
from nimmer_train.loras.train import Conversation, encode, token_losses
from nimmer_train.progress import Progress
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, render_reply_spans
from nimmer_train.voice.registers import RegistersConfig
from nimmer_train.voice.sampling import NEUTRAL_WARPERS, baseline, knob_processors
from nimmer_train.voice.structured import end_of_turn_ids

TOKEN_CLASSES = ("utterance", "fields", "format")
EVAL_SETS = ("r1", "r0")
HEADLINE = ("r1", "utterance")  # what `separability` and `mean_gain` name
BOOTSTRAP_SAMPLES = 1000
CONFIDENCE = 0.95
BASE = "base"  # the column of the bare base in a matrix


@dataclass(frozen=True)
class Estimate:
    value: float
    low: float  # the CONFIDENCE percentile-bootstrap interval
    high: float


@dataclass(frozen=True)
class Cell:
    loss: float  # token-weighted mean, nats per token
    low: float
    high: float
    n: int  # conversations
    tokens: int


@dataclass(frozen=True)
class Scores:
    """One evaluation set on one token class."""

    registers: list[str]  # data registers with held-out conversations here
    matrix: dict[str, dict[str, Cell]]  # [data register][adapter or BASE]
    separability: Estimate  # share of registers whose own adapter has the lowest loss
    mean_gain: Estimate  # mean over registers of (base loss - own-adapter loss)
    margins: dict[str, Estimate]  # [register] best rival adapter's loss - own adapter's (> 0: own wins)


@dataclass(frozen=True)
class Evaluation:
    registers: list[str]  # the adapters
    scores: dict[str, dict[str, Scores]]  # [evaluation set][token class]
    samples: list[dict[str, Any]]

    @property
    def headline(self) -> Scores:
        return self.scores[HEADLINE[0]][HEADLINE[1]]

    @property
    def separability(self) -> float:
        """Separability on utterance tokens of the curated held-out replies."""
        return self.headline.separability.value

    @property
    def mean_gain(self) -> float:
        """Mean gain over the base on utterance tokens of the curated held-out replies."""
        return self.headline.mean_gain.value

    def summary(self) -> dict[str, Any]:
        """Everything but the samples, as plain JSON (for the model card and the manifest; NaN,
        a figure that does not exist, becomes null)."""
        return _json_safe(
            {
                "registers": self.registers,
                "headline": {"set": HEADLINE[0], "tokens": HEADLINE[1]},
                "confidence": CONFIDENCE,
                "bootstrap_samples": BOOTSTRAP_SAMPLES,
                "scores": {
                    name: {cls: asdict(s) for cls, s in by_class.items()}
                    for name, by_class in self.scores.items()
                },
            }
        )

    @classmethod
    def from_summary(cls, summary: dict[str, Any], samples: list[dict[str, Any]]) -> Evaluation:
        """The evaluation :meth:`summary` wrote (a null figure back to NaN) and its samples."""

        def figure(value: float | None) -> float:
            return float("nan") if value is None else float(value)

        def estimate(e: dict[str, Any]) -> Estimate:
            return Estimate(figure(e["value"]), figure(e["low"]), figure(e["high"]))

        def scores(s: dict[str, Any]) -> Scores:
            matrix = {
                data: {
                    col: Cell(figure(c["loss"]), figure(c["low"]), figure(c["high"]), c["n"], c["tokens"])
                    for col, c in row.items()
                }
                for data, row in s["matrix"].items()
            }
            margins = {r: estimate(m) for r, m in s["margins"].items()}
            sep, gain = estimate(s["separability"]), estimate(s["mean_gain"])
            return Scores(s["registers"], matrix, sep, gain, margins)

        return cls(
            list(summary["registers"]),
            {name: {c: scores(v) for c, v in by.items()} for name, by in summary["scores"].items()},
            list(samples),
        )

    def metrics(self) -> dict[str, float]:
        """Flat MLflow metrics per ``<set>.<class>``: ``separability.`` and ``mean_gain.`` (with
        ``_low`` / ``_high``), ``margin.<...>.<register>`` (also with both), ``loss.<...>.<register>.own`` and
        ``.base``; and ``n.<set>.<register>`` (conversations). The full matrices are artifacts."""
        out: dict[str, float] = {}
        for name, by_class in self.scores.items():
            for cls, s in by_class.items():
                key = f"{name}.{cls}"
                for metric, est in (("separability", s.separability), ("mean_gain", s.mean_gain)):
                    out |= {
                        f"{metric}.{key}": est.value,
                        f"{metric}.{key}_low": est.low,
                        f"{metric}.{key}_high": est.high,
                    }
                for data, row in s.matrix.items():
                    margin = s.margins[data]
                    out[f"margin.{key}.{data}"] = margin.value
                    out[f"margin.{key}.{data}_low"] = margin.low
                    out[f"margin.{key}.{data}_high"] = margin.high
                    out[f"loss.{key}.{data}.own"] = row[data].loss
                    out[f"loss.{key}.{data}.base"] = row[BASE].loss
                    out[f"n.{name}.{data}"] = row[BASE].n
        return {k: v for k, v in out.items() if np.isfinite(v)}

    def table(self, name: str, cls: str) -> list[dict[str, Any]]:
        """The matrix as rows (data register, n, then base and each adapter as "loss [low, high]")."""
        s = self.scores[name][cls]
        return [
            {
                "data": data,
                "n": row[BASE].n,
                "tokens": row[BASE].tokens,
                **{col: f"{c.loss:.3f} [{c.low:.3f}, {c.high:.3f}]" for col, c in row.items()},
            }
            for data, row in s.matrix.items()
        ]


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return None
    return value


def token_classes(tokenizer: PreTrainedTokenizerBase, conversation: Conversation, max_length: int) -> dict:
    """:func:`~nimmer_train.loras.train.encode`'s ids and labels plus ``classes``: for each
    position the index in :data:`TOKEN_CLASSES` of its token (-1 where it is not scored)."""
    enc = encode(tokenizer, conversation, max_length)
    text = tokenizer.apply_chat_template(conversation, tokenize=False)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if offsets["input_ids"][: len(enc["input_ids"])] != enc["input_ids"]:
        raise NimmerError("the chat template's text does not tokenize to its ids; cannot place tokens")
    content = conversation[-1]["content"]
    rendered, spans = render_reply_spans(json.loads(content), TURN_SCHEMA)
    if rendered != content:
        raise NimmerError(f"a held-out reply is not in the training format: {content[:80]!r}")
    start = text.rindex(content)
    utterance = spans.get("utterance", (0, 0))
    fields = [span for key, span in spans.items() if key != "utterance"]

    def overlaps(a: int, b: int, span: tuple[int, int]) -> bool:
        return a - start < span[1] and b - start > span[0]

    classes = []
    for (a, b), label in zip(offsets["offset_mapping"], enc["labels"], strict=False):
        if label == -100:
            classes.append(-1)
        elif overlaps(a, b, utterance):
            classes.append(0)
        elif any(overlaps(a, b, span) for span in fields):
            classes.append(1)
        else:
            classes.append(2)
    return {**enc, "classes": classes}


def _class_sums(losses: np.ndarray, classes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(loss sum, token count) per token class of one conversation."""
    cls = np.asarray(classes)
    scored = ~np.isnan(losses)
    sums = np.array([losses[scored & (cls == c)].sum() for c in range(len(TOKEN_CLASSES))])
    counts = np.array([(scored & (cls == c)).sum() for c in range(len(TOKEN_CLASSES))])
    return sums, counts


def _interval(values: np.ndarray) -> tuple[float, float]:
    tail = 100 * (1 - CONFIDENCE) / 2
    finite = values[np.isfinite(values)]
    if not len(finite):
        return float("nan"), float("nan")
    low, high = np.percentile(finite, [tail, 100 - tail])
    return float(low), float(high)


def score(
    columns: list[str], sums: dict[str, np.ndarray], counts: dict[str, np.ndarray], seed: int
) -> dict[str, Scores]:
    """Scores per token class from per-conversation sums. ``columns``: BASE then the adapters;
    ``sums[data]``: (conversations, columns, classes) loss sums; ``counts[data]``:
    (conversations, classes) token counts. Registers without conversations are left out."""
    data = [r for r in sums if len(sums[r])]
    adapters = [c for c in columns if c != BASE]
    if not data:
        none = Estimate(float("nan"), float("nan"), float("nan"))
        return {cls: Scores([], {}, none, none, {}) for cls in TOKEN_CLASSES}
    rng = np.random.default_rng(seed)
    draws = {r: rng.integers(0, len(sums[r]), (BOOTSTRAP_SAMPLES, len(sums[r]))) for r in data}
    out = {}
    with np.errstate(invalid="ignore", divide="ignore"):
        for c, cls in enumerate(TOKEN_CLASSES):
            # point losses (registers, columns) and bootstrap losses (samples, registers, columns)
            point = np.stack([sums[r][:, :, c].sum(0) / counts[r][:, c].sum() for r in data])
            boot = np.stack(
                [sums[r][draws[r], :, c].sum(1) / counts[r][draws[r], c].sum(1)[:, None] for r in data],
                axis=1,
            )
            out[cls] = _scores(data, columns, adapters, point, boot, sums, counts, c)
    return out


def _scores(
    data: list[str],
    columns: list[str],
    adapters: list[str],
    point: np.ndarray,
    boot: np.ndarray,
    sums: dict[str, np.ndarray],
    counts: dict[str, np.ndarray],
    c: int,
) -> Scores:
    own = [columns.index(r) for r in data]
    rivals = [[columns.index(a) for a in adapters if a != r] for r in data]
    base = columns.index(BASE)

    def stats(loss: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(separability, mean gain, margins by register) of losses shaped (..., registers, columns);
        NaN where a figure does not exist (a single adapter has no rival; a class without tokens)."""
        mine = np.stack([loss[..., i, j] for i, j in enumerate(own)], axis=-1)
        nan = np.full(loss.shape[:-2], np.nan)
        best_rival = np.stack(
            [loss[..., i, js].min(-1) if js else nan for i, js in enumerate(rivals)], axis=-1
        )
        margins = best_rival - mine
        gain = (np.stack([loss[..., i, base] for i in range(len(data))], axis=-1) - mine).mean(-1)
        unknown = np.isnan(margins).any(-1) | (len(adapters) < 2)  # a register without a figure
        separability = np.where(unknown, np.nan, (margins > 0).mean(-1))
        return separability, gain, margins

    sep, gain, margins = stats(point)
    sep_b, gain_b, margins_b = stats(boot)
    matrix = {
        r: {
            col: Cell(
                float(point[i, j]),
                *_interval(boot[:, i, j]),
                n=len(sums[r]),
                tokens=int(counts[r][:, c].sum()),
            )
            for j, col in enumerate(columns)
        }
        for i, r in enumerate(data)
    }
    return Scores(
        registers=data,
        matrix=matrix,
        separability=Estimate(float(sep), *_interval(sep_b)),
        mean_gain=Estimate(float(gain), *_interval(gain_b)),
        margins={r: Estimate(float(margins[i]), *_interval(margins_b[:, i])) for i, r in enumerate(data)},
    )


def evaluate(
    base_dir: Path,
    adapters: dict[str, Path],
    heldout: dict[str, dict[str, list[Conversation]]],
    catalogue: RegistersConfig,
    settings: LoraConfig,
) -> Evaluation:
    """Held-out losses of the base alone and with every adapter (switched per call on one model)
    on ``heldout[set][register]``, scored per token class, plus one sample per register."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = load_all(base_dir, list(adapters.values()))
    names = list(adapters)
    columns = [BASE, *names]
    scores = {}
    progress, done = Progress("train_loras held-out matrix", len(EVAL_SETS) * len(names)), 0
    for name in EVAL_SETS:
        sums, counts = {}, {}
        for data_reg in names:
            progress.update(done)  # minutes on a real base: the ETA after the first register's row
            done += 1
            batch = [
                token_classes(tokenizer, c, settings.max_length) for c in heldout[name].get(data_reg, [])
            ]
            sums[data_reg] = np.zeros((len(batch), len(columns), len(TOKEN_CLASSES)))
            counts[data_reg] = np.zeros((len(batch), len(TOKEN_CLASSES)), dtype=int)
            for j, col in enumerate(columns):
                for i, (losses, row) in enumerate(
                    zip(_losses(model, col, batch, tokenizer, settings.dtype), batch, strict=True)
                ):
                    sums[data_reg][i, j], counts[data_reg][i] = _class_sums(losses, row["classes"])
        scores[name] = score(columns, sums, counts, settings.seed)
    progress.update(done)
    progress.close()
    samples = [
        _sample(model, tokenizer, r, heldout["r1"][r][0], catalogue, settings)
        for r in names
        if heldout["r1"].get(r)
    ]
    return Evaluation(names, scores, samples)


def _losses(
    model: Any, column: str, batch: list[dict], tokenizer: Any, dtype: str = "float32"
) -> list[np.ndarray]:
    """Per-token losses of ``batch`` under one column: the bare base or one adapter, the forward
    passes in ``dtype`` (``lora.dtype``)."""
    if column == BASE:
        with model.disable_adapter():
            return token_losses(model, batch, tokenizer.pad_token_id, dtype)
    model.set_adapter(column)
    return token_losses(model, batch, tokenizer.pad_token_id, dtype)


def _sample(
    model: Any,
    tokenizer: Any,
    register: str,
    conversation: Conversation,
    catalogue: RegistersConfig,
    settings: LoraConfig,
) -> dict[str, Any]:
    """One generation with the register's adapter at the register's baseline sampling, stopping
    at the chat template's end-of-turn token."""
    model.set_adapter(register)
    knobs = baseline(catalogue, register)
    prompt = tokenizer.apply_chat_template(
        conversation[:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
    ).to(next(model.parameters()).device)
    width = prompt["input_ids"].shape[1]
    stop = end_of_turn_ids(tokenizer)
    torch.manual_seed(settings.seed)
    out = model.generate(
        **prompt,
        **NEUTRAL_WARPERS,
        logits_processor=knob_processors(knobs, width),
        max_new_tokens=settings.sample_max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=stop,
    )
    new = out[0, width:].tolist()
    return {
        "register": register,
        "player": conversation[-2]["content"],
        "reference": conversation[-1]["content"],
        "generated": tokenizer.decode(new, skip_special_tokens=True),
        "tokens": len(new),
        "ended_turn": bool(new) and new[-1] in stop,
    }
