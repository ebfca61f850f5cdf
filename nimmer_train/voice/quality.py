"""The voice report's figures: how a version's NPCs speak, scored on turns generated through
Ring A. This module holds what needs nothing above the voice layer: the metrics, the register
classifier trained on the seed set, the report (:class:`VoiceReport`, :func:`score`) and its text.
Drawing the prompts (from the scenes held out of the adapters' training sets), generating the
turns through Ring A's ``LocalModel`` and ``voice_eval`` live in
:mod:`nimmer_train.runtime.voice_eval`; publish writes the report into each new version's model
card (before signing, on the very weights and LoRAs it publishes) and the speak stage measures the
version it loaded with the same set (the settings and held-out scenes its manifest records).

Every figure but distinct-2 and mean words is per reply, over **all** of a register's turns (a
reply that fails the schema counts as 0 English, not speaking, a register miss); the overall row
is the mean over registers (macro), so no register and no long reply outweighs the others:

- ``schema_valid``: share of replies that parse and validate against the turn schema;
- ``english_rate``: mean over replies of the share of the reply's word tokens (``wordfreq``
  tokens with a letter, a trailing 's dropped) that are English (:func:`is_english`: Zipf >=
  :data:`ENGLISH_ZIPF` in wordfreq's list, >= 4.0 for 3 letters and >= 5.0 for 2, a lone letter
  only as "a", "I", "O": subword fragments such as "er", "th", "nt", "bal" fall out); a reply
  without a word scores 0. The hand-written seed set scores 0.982 (0.983 before the short-word
  bars and the 's; its names and archaic forms, "Ilse", "cisterns", "askest", are what it
  loses). It is lexical: word salad made of real words scores high; read it beside the samples
  and distinct-2;
- ``speaks``: share of replies of :data:`SPEAKS_WORDS` words or more (fragments are visible);
- ``register_accuracy``: a register classifier trained on the hand-written seed set (character
  1-4-gram TF-IDF, word-bounded and sublinear, and a logistic regression) labels each utterance;
  share of turns labelled with the register that spoke. It abstains (label ``none``, a miss) on
  replies under :data:`SPEAKS_WORDS` words and below the confidence that 98 % of the seed lines
  reach in its leave-one-scene-out cross-validation; a reply that copies a seed line is a miss
  too. Chance is 1/registers; its cross-validated accuracy on the seed set is its ceiling;
- ``abstain_rate``: share of turns the classifier abstained on (``predicted``: every label);
- ``copy_rate``: share of replies that repeat :data:`COPY_RUN` consecutive words of a seed line,
  or a whole 5-7-word reply found in one (the replay teacher's r1 set is the seed lines);
- ``distinct_2``: distinct word bigrams / all word bigrams of a register's valid utterances
  (it falls as the sample grows: compare it only at equal turns and lengths);
- ``mean_words``: mean valid utterance length in words.

- ``repeats``: replies that say one sentence (the same words between sentence marks) more than
  :data:`REPEAT_LIMIT` times; the overall row counts them over every register.

Intervals (issue 38): schema-valid, English, register accuracy and distinct-2, per register and
overall, each with a :data:`CONFIDENCE` percentile interval of a **cluster bootstrap over the
scenes** the turns were spoken in (:func:`cluster_bootstrap`): a resample draws scenes with
replacement and takes every turn of each drawn scene, all registers together, so the interval
shows how much the figure moves with the scenes, not with more turns of the same scenes. Every
figure is a ratio of sums over turns, recomputed on each resample; for distinct-2 each of a
reply's bigrams weighs 1 / (its count among the register's replies), so the sums give distinct-2
exactly and a resample reweighs the scenes' shares (a repeated scene does not count as its own
repetition). Under :data:`MIN_SCENES` scenes no interval is given (2 scenes allow 3 resamples).

The bar (:func:`bar_checks`, printed by publish and the speak stage and in the model card):
:data:`GOALS` on the overall row, :data:`EACH_REGISTER` on every register, no repeating reply;
judged on the figure itself, its interval shown beside it.

The register x adapter held-out loss matrix (issue 4, :mod:`nimmer_train.loras.evaluation`) is not
recomputed: its headline rides along.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import warnings
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.errors import NimmerError
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, ReplyError, validate_reply

ENGLISH_ZIPF = 2.5
SHORT_ZIPF = {2: 5.0, 3: 4.0}  # fragments of 2-3 letters ("er" 4.2, "th" 4.2, "bal" 3.1) sit below
LETTER_WORDS = frozenset("aio")  # the only one-letter English words
SPEAKS_WORDS = 3  # a reply shorter than this does not speak; the classifier abstains on it
ABSTAIN_QUANTILE = 0.02  # abstain below the confidence 98 % of seed lines reach under CV
COPY_RUN, COPY_MIN = 8, 5  # a copy: 8 consecutive words of a seed line, or a whole 5-7-word reply
NONE, INVALID = "none", "invalid"  # the labels of an abstention and of a reply that fails the schema
GOALS = {"schema_valid": 0.98, "english_rate": 0.95, "register_accuracy": 0.80}  # overall (issue 38)
EACH_REGISTER = {"register_accuracy": 0.60, "distinct_2": 0.45}  # every register's own (issue 38)
REPEAT_LIMIT = 2  # a reply may say one sentence at most twice; the bar: no reply over it
CONFIDENCE = 0.95  # the intervals' level
BOOTSTRAP = 2000  # scene resamples per interval
MIN_SCENES = 5  # fewer scenes give too few distinct resamples for an interval (4 give 35)
INTERVALS = ("schema_valid", "english_rate", "register_accuracy", "distinct_2")  # with an interval
FIGURES = (
    "schema_valid",
    "english_rate",
    "register_accuracy",
    "speaks",
    "abstain_rate",
    "copy_rate",
    "distinct_2",
    "mean_words",
)
CV = "leave-one-scene-out"
SAMPLES = 3  # utterances kept per register in the report


# --- the figures on plain text ------------------------------------------------------------------


def words(text: str) -> list[str]:
    """The word tokens of ``text`` (wordfreq's English tokenizer, lowercased; tokens with a letter)."""
    from wordfreq import tokenize

    return [w for w in tokenize(text, "en") if any(c.isalpha() for c in w)]


@lru_cache(maxsize=65536)
def is_english(word: str) -> bool:
    """``word`` (a :func:`words` token) is English: its Zipf frequency, a trailing 's dropped, is
    >= :data:`ENGLISH_ZIPF` (>= :data:`SHORT_ZIPF` for 2 and 3 letters); a lone letter only if a word."""
    from wordfreq import zipf_frequency

    stem = word.removesuffix("'s").removesuffix("\u2019s") or word
    if len(stem) == 1:
        return stem in LETTER_WORDS
    return zipf_frequency(stem, "en") >= SHORT_ZIPF.get(len(stem), ENGLISH_ZIPF)


def english_share(text: str) -> float:
    """Share of ``text``'s words that are English; 0 when it has no word."""
    tokens = words(text)
    return sum(map(is_english, tokens)) / len(tokens) if tokens else 0.0


def english_rate(texts: list[str]) -> float | None:
    """Mean over ``texts`` of :func:`english_share` (each reply weighs the same); None: no text."""
    return sum(map(english_share, texts)) / len(texts) if texts else None


def distinct_n(texts: list[str], n: int = 2) -> float | None:
    """Distinct word n-grams over all word n-grams of ``texts`` (none across a text's end)."""
    grams = [tuple(ws[i : i + n]) for text in texts for ws in [words(text)] for i in range(len(ws) - n + 1)]
    return len(set(grams)) / len(grams) if grams else None


def mean_words(texts: list[str]) -> float | None:
    return sum(len(words(t)) for t in texts) / len(texts) if texts else None


def copy_grams(texts: list[str]) -> frozenset[tuple[str, ...]]:
    """Every run of :data:`COPY_MIN` to :data:`COPY_RUN` consecutive words of ``texts``."""
    out: set[tuple[str, ...]] = set()
    for text in texts:
        ws = words(text)
        out.update(
            tuple(ws[i : i + n]) for n in range(COPY_MIN, COPY_RUN + 1) for i in range(len(ws) - n + 1)
        )
    return frozenset(out)


def copies(text: str, grams: frozenset[tuple[str, ...]]) -> bool:
    """``text`` repeats :data:`COPY_RUN` consecutive words of a line of ``grams`` (:func:`copy_grams`),
    or is, whole, a run of :data:`COPY_MIN` words or more of one."""
    ws = words(text)
    if len(ws) >= COPY_RUN:
        return any(tuple(ws[i : i + COPY_RUN]) in grams for i in range(len(ws) - COPY_RUN + 1))
    return len(ws) >= COPY_MIN and tuple(ws) in grams


SENTENCE_END = re.compile(r"[.!?\u2026\n]+")  # what ends a sentence (... and a line break too)


def repeats_sentence(text: str, limit: int = REPEAT_LIMIT) -> bool:
    """``text`` says one sentence (the same :func:`words` between sentence marks, any case or
    punctuation inside) more than ``limit`` times: "Halt. Halt. Halt." does, "Halt. Halt." not."""
    said = Counter(tuple(ws) for part in SENTENCE_END.split(text) if (ws := words(part)))
    return bool(said) and max(said.values()) > limit


def parse_reply(text: str | None, schema: dict[str, Any] = TURN_SCHEMA) -> dict[str, Any] | None:
    """The reply if ``text`` is valid under ``schema``, else None."""
    try:
        return validate_reply(text, schema)
    except ReplyError:
        return None


# --- the register classifier --------------------------------------------------------------------


@dataclass(frozen=True)
class SeedLine:
    register: str
    scene: str
    utterance: str


def seed_lines(path: Path) -> list[SeedLine]:
    """The hand-written seed set's utterances (data/seed/teacher_replay_v1.jsonl rows)."""
    if not path.is_file():
        raise NimmerError(f"no seed set at {path} (publish.voice_eval.seed_set)")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            reply = json.loads(row["response"]["content"])
            out.append(SeedLine(row["register"], row.get("scene", ""), str(reply["utterance"])))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise NimmerError(
                f"{path}:{n}: not a seed row with a register and a reply with an utterance ({exc})"
            ) from exc
    return out


@dataclass(frozen=True)
class RegisterClassifier:
    """Character n-gram TF-IDF + logistic regression, fitted on the seed set, that abstains on
    fragments and on low confidence; it also holds the seed lines' word runs (copies)."""

    pipeline: Any  # sklearn Pipeline
    registers: list[str]
    trained_on: int  # seed lines
    cv_accuracy: float | None  # leave-one-scene-out on the seed set: the classifier's ceiling
    source: str  # the seed set's file name and sha256 prefix
    threshold: float = 0.0  # abstain below this top probability (0: on fragments only)
    cv_abstain: float | None = None  # share of seed lines abstained on under CV
    seed_grams: frozenset[tuple[str, ...]] = frozenset()  # for :func:`copies`

    def predict(self, texts: list[str]) -> list[str]:
        """The most likely register of each text (never abstains)."""
        return [str(p) for p in self.pipeline.predict(texts)] if texts else []

    def label(self, texts: list[str]) -> list[str]:
        """Each text's register, or :data:`NONE` under :data:`SPEAKS_WORDS` words or below the threshold."""
        if not texts:
            return []
        probs = self.pipeline.predict_proba(texts)
        classes = [str(c) for c in self.pipeline.classes_]
        return [
            classes[int(p.argmax())] if len(words(t)) >= SPEAKS_WORDS and p.max() >= self.threshold else NONE
            for t, p in zip(texts, probs, strict=True)
        ]

    def describe(self) -> str:
        cv = (
            f"{CV} accuracy {self.cv_accuracy:.3f} on them, its ceiling; it abstains under "
            f"{SPEAKS_WORDS} words and below top probability {self.threshold:.2f} (the "
            f"{ABSTAIN_QUANTILE:.0%} quantile of its {CV} confidence: {self.cv_abstain:.1%} of seed lines)"
            if self.cv_accuracy is not None and self.cv_abstain is not None
            else f"no CV; it abstains under {SPEAKS_WORDS} words"
        )
        return (
            f"char 1-4-gram TF-IDF + logistic regression on {self.trained_on} hand-written seed lines "
            f"({self.source}); {cv}"
        )


def _pipeline() -> Any:
    from sklearn.feature_extraction.text import TfidfVectorizer
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline

    return make_pipeline(
        TfidfVectorizer(analyzer="char_wb", ngram_range=(1, 4), sublinear_tf=True),
        LogisticRegression(C=10.0, max_iter=2000),
    )


def fit_classifier(lines: list[SeedLine], source: str = "seed set") -> RegisterClassifier:
    """Fit on ``lines``; cross-validated by scene (each fold holds one scene out) when there are two
    scenes or more and every fold still trains on two registers or more, which also calibrates
    the abstention threshold (:data:`ABSTAIN_QUANTILE` of the out-of-fold top probabilities)."""
    from sklearn.model_selection import LeaveOneGroupOut, cross_val_predict

    texts, labels = [x.utterance for x in lines], [x.register for x in lines]
    if len(set(labels)) < 2:
        raise NimmerError(f"the seed set ({source}) needs lines of two registers or more to train on")
    scenes = [x.scene for x in lines]
    cv = threshold = cv_abstain = None
    folds = [{r for r, g in zip(labels, scenes, strict=True) if g != held} for held in set(scenes)]
    if len(folds) >= 2 and all(len(f) >= 2 for f in folds):
        probs = cross_val_predict(
            _pipeline(), texts, labels, groups=scenes, cv=LeaveOneGroupOut(), method="predict_proba"
        )
        classes = sorted(set(labels))
        cv = float(np.mean([classes[int(p.argmax())] == y for p, y in zip(probs, labels, strict=True)]))
        top = probs.max(axis=1)
        threshold = float(np.quantile(top, ABSTAIN_QUANTILE))
        cv_abstain = float(np.mean(top < threshold))
    fitted = _pipeline().fit(texts, labels)
    return RegisterClassifier(
        fitted, sorted(set(labels)), len(lines), cv, source, threshold or 0.0, cv_abstain, copy_grams(texts)
    )


@lru_cache(maxsize=4)
def _seed_classifier(path: str, sha256: str) -> RegisterClassifier:
    return fit_classifier(seed_lines(Path(path)), f"{Path(path).name} sha256 {sha256[:12]}")


def seed_classifier(path: Path) -> RegisterClassifier:
    """The classifier of the seed set at ``path`` (fitted once per process and file content)."""
    if not path.is_file():
        raise NimmerError(f"no seed set at {path} (publish.voice_eval.seed_set)")
    return _seed_classifier(str(path), hashlib.sha256(path.read_bytes()).hexdigest())


# --- the report ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GeneratedTurn:
    register: str
    text: str | None  # the raw reply
    seconds: float = 0.0
    error: str | None = None  # generation failed
    scene: str = ""  # the scene it was spoken in: the intervals' cluster

    @property
    def reply(self) -> dict[str, Any] | None:
        return parse_reply(self.text)

    @property
    def utterance(self) -> str | None:
        reply = self.reply
        return str(reply["utterance"]) if reply is not None else None


@dataclass(frozen=True)
class VoiceFigures:
    """One register's figures (``register`` "all": the mean over registers). Per-reply figures
    are over all ``turns``; distinct-2 and mean words over the ``valid`` ones."""

    register: str
    turns: int
    valid: int  # schema-valid replies
    schema_valid: float
    english_rate: float | None  # None: no turn
    register_accuracy: float | None  # None: the classifier does not know this register
    speaks: float | None
    abstain_rate: float | None
    copy_rate: float | None
    distinct_2: float | None
    mean_words: float | None
    predicted: dict[str, int] = field(default_factory=dict)  # label (or none / invalid) -> turns
    samples: list[str] = field(default_factory=list)
    repeats: int = 0  # replies saying one sentence more than REPEAT_LIMIT times
    intervals: dict[str, list[float]] = field(default_factory=dict)  # figure -> [low, high]


@dataclass(frozen=True)
class VoiceReport:
    version: str
    registers: list[VoiceFigures]
    overall: VoiceFigures
    chance: float  # 1 / the classifier's registers
    classifier: str  # what labels the utterances, with its ceiling and abstention
    classifier_cv_accuracy: float | None
    english_zipf: float
    settings: dict[str, Any]  # turns_per_register, max_new_tokens, seed, ring, adapters, held-out scenes
    heldout_loss: dict[str, Any] | None  # issue 4's matrix headline; None: no evaluation
    seconds: float
    goals: dict[str, float] = field(default_factory=lambda: dict(GOALS))
    classifier_threshold: float = 0.0
    short_zipf: dict[int, float] = field(default_factory=lambda: dict(SHORT_ZIPF))
    each_register: dict[str, float] = field(default_factory=lambda: dict(EACH_REGISTER))
    repeat_limit: int = REPEAT_LIMIT
    interval_scenes: list[str] = field(default_factory=list)  # the clusters the intervals resample
    confidence: float = CONFIDENCE
    bootstrap: int = BOOTSTRAP  # resamples; 0: no interval (fewer than MIN_SCENES scenes)

    def summary(self) -> dict[str, Any]:
        """The report as plain JSON (the manifest's ``voice_report``)."""
        return json.loads(json.dumps(dataclasses.asdict(self)))

    def metrics(self) -> dict[str, float]:
        """Flat MLflow metrics, the same names from publish and speak:
        ``voice.<vN>.<register or all>.<figure>`` (``<figure>_low`` / ``_high``: its interval;
        ``repeats``), ``voice.<vN>.chance``, ``voice.<vN>.scenes`` and ``voice.<vN>.seconds``."""
        short = self.version.rsplit("-", 1)[-1]
        prefix = f"voice.{short}." if short else "voice."
        out = {
            f"{prefix}chance": self.chance,
            f"{prefix}seconds": self.seconds,
            f"{prefix}scenes": float(len(self.interval_scenes)),
        }
        for figures in (self.overall, *self.registers):
            for name in FIGURES:
                value = getattr(figures, name)
                if value is not None:
                    out[f"{prefix}{figures.register}.{name}"] = float(value)
            for name, (low, high) in figures.intervals.items():
                out[f"{prefix}{figures.register}.{name}_low"] = float(low)
                out[f"{prefix}{figures.register}.{name}_high"] = float(high)
            out[f"{prefix}{figures.register}.repeats"] = float(figures.repeats)
        return out

    def lines(self) -> list[str]:
        """The report as text, goals beside the values."""
        return report_lines(self.summary())

    def bar(self) -> list[dict[str, Any]]:
        """Pass or fail per goal (:func:`bar_checks`)."""
        return bar_checks(self.summary())


def score(
    turns: list[GeneratedTurn],
    classifier: RegisterClassifier,
    version: str = "",
    settings: dict[str, Any] | None = None,
    heldout_loss: dict[str, Any] | None = None,
    seconds: float = 0.0,
    draws: int = BOOTSTRAP,
) -> VoiceReport:
    """The report of ``turns``, one row per register (sorted) and their mean, each figure with its
    scene-bootstrap interval (``draws`` resamples) when the turns span :data:`MIN_SCENES` scenes."""
    by_register: dict[str, list[GeneratedTurn]] = {}
    for turn in turns:
        by_register.setdefault(turn.register, []).append(turn)
    scenes = sorted({t.scene for t in turns})
    draws = draws if len(scenes) >= MIN_SCENES else 0
    measured = [_figures(name, group, classifier) for name, group in sorted(by_register.items())]
    rows = [row for row, _ in measured]
    overall = _overall(rows)
    if draws:
        values = [v for _, v in measured]
        per_row, mean = scene_intervals(values, scenes, draws, resample_seed(settings))
        rows = [dataclasses.replace(r, intervals=i) for r, i in zip(rows, per_row, strict=True)]
        overall = dataclasses.replace(overall, intervals=mean)
    return VoiceReport(
        version=version,
        registers=rows,
        overall=overall,
        chance=1 / len(classifier.registers),
        classifier=classifier.describe(),
        classifier_cv_accuracy=classifier.cv_accuracy,
        english_zipf=ENGLISH_ZIPF,
        settings=settings or {},
        heldout_loss=heldout_loss,
        seconds=round(seconds, 2),
        classifier_threshold=classifier.threshold,
        interval_scenes=scenes,
        bootstrap=draws,
    )


def resample_seed(settings: dict[str, Any] | None) -> int:
    """The resampling seed: the report's own seed, so a report is reproducible."""
    return int((settings or {}).get("seed", 0) or 0)


@dataclass(frozen=True)
class TurnValues:
    """One register's per-turn shares of each :data:`INTERVALS` figure, as (numerator,
    denominator) arrays over its turns: the figure is sum(numerator) / sum(denominator), over any
    set of turns, so a resample of scenes recomputes it exactly."""

    scenes: list[str]  # each turn's scene
    parts: dict[str, tuple[np.ndarray, np.ndarray]]  # figure -> (numerator, denominator) per turn


def _turn_values(
    name: str, turns: list[GeneratedTurn], utterances: list[str | None], hits: list[bool], known: bool
) -> TurnValues:
    ones = np.ones(len(turns))
    grams = [
        [tuple(ws[i : i + 2]) for i in range(len(ws) - 1)] for u in utterances for ws in [words(u or "")]
    ]
    counts = Counter(g for gs in grams for g in gs)
    parts = {
        "schema_valid": (np.array([u is not None for u in utterances], float), ones),
        "english_rate": (np.array([english_share(u) if u is not None else 0.0 for u in utterances]), ones),
        "distinct_2": (
            np.array([sum(1 / counts[g] for g in gs) for gs in grams]),
            np.array([len(gs) for gs in grams], float),
        ),
    }
    if known:
        parts["register_accuracy"] = (np.array(hits, float), ones)
    return TurnValues([t.scene for t in turns], parts)


def cluster_bootstrap(num: np.ndarray, den: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Ratio estimates sum(num) / sum(den) under each row of ``weights`` (draws x scenes: how
    often each scene is drawn); ``num`` and ``den`` are per-scene sums (... x scenes). NaN where a
    resample has no denominator (e.g. distinct-2 of resampled scenes without a valid reply)."""
    n, d = num @ weights.T, den @ weights.T
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(d > 0, n / np.where(d > 0, d, 1.0), np.nan)


def scene_weights(scenes: int, draws: int, seed: int) -> np.ndarray:
    """``draws`` resamples of ``scenes`` scenes with replacement: how often each is drawn."""
    return np.random.default_rng([seed, scenes]).multinomial(scenes, np.full(scenes, 1 / scenes), draws)


def percentile_interval(estimates: np.ndarray, confidence: float = CONFIDENCE) -> list[float] | None:
    """The percentile interval of bootstrap ``estimates`` (NaN left out; None when most are NaN)."""
    known = estimates[np.isfinite(estimates)]
    if len(known) < len(estimates) / 2 or not len(known):
        return None
    tail = (1 - confidence) / 2
    low, high = np.quantile(known, [tail, 1 - tail], method="inverted_cdf")
    return [round(float(low), 4), round(float(high), 4)]


def scene_intervals(
    values: list[TurnValues], scenes: list[str], draws: int, seed: int
) -> tuple[list[dict[str, list[float]]], dict[str, list[float]]]:
    """Each register's and the overall (mean over registers) intervals of :data:`INTERVALS`, all
    from the same resamples of ``scenes`` (a drawn scene brings every register's turns in it)."""
    at = {s: i for i, s in enumerate(scenes)}
    weights = scene_weights(len(scenes), draws, seed)
    estimates: dict[str, list[np.ndarray]] = {name: [] for name in INTERVALS}
    per_row: list[dict[str, list[float]]] = []
    for v in values:
        index = np.array([at[s] for s in v.scenes], int)
        row: dict[str, list[float]] = {}
        for name, (num, den) in v.parts.items():
            sums = [np.bincount(index, weights=x, minlength=len(scenes)) for x in (num, den)]
            if sums[1].sum() == 0:
                continue  # no value (e.g. distinct-2 without a bigram): left out of the mean too
            est = cluster_bootstrap(sums[0], sums[1], weights)
            estimates[name].append(est)
            interval = percentile_interval(est)
            if interval is not None:
                row[name] = interval
        per_row.append(row)
    overall: dict[str, list[float]] = {}
    for name, rows in estimates.items():
        if rows:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)  # a resample where every row is NaN
                interval = percentile_interval(np.nanmean(np.stack(rows), axis=0))
            if interval is not None:
                overall[name] = interval
    return per_row, overall


def _figures(
    name: str, turns: list[GeneratedTurn], classifier: RegisterClassifier
) -> tuple[VoiceFigures, TurnValues]:
    utterances = [t.utterance for t in turns]
    texts = [u for u in utterances if u is not None]
    labelled = iter(classifier.label(texts))
    labels = [INVALID if u is None else next(labelled) for u in utterances]
    copied = [u is not None and copies(u, classifier.seed_grams) for u in utterances]
    n = len(turns)
    hit = [label == name and not c for label, c in zip(labels, copied, strict=True)]
    known = name in classifier.registers
    row = VoiceFigures(
        register=name,
        turns=n,
        valid=len(texts),
        schema_valid=len(texts) / n if n else 0.0,
        english_rate=sum(english_share(u) for u in texts) / n if n else None,
        register_accuracy=sum(hit) / n if n and known else None,
        speaks=sum(len(words(u)) >= SPEAKS_WORDS for u in texts) / n if n else None,
        abstain_rate=labels.count(NONE) / n if n else None,
        copy_rate=sum(copied) / n if n else None,
        distinct_2=distinct_n(texts, 2),
        mean_words=mean_words(texts),
        predicted=dict(sorted(Counter(labels).items())),
        samples=texts[:SAMPLES],
        repeats=sum(map(repeats_sentence, texts)),
    )
    return row, _turn_values(name, turns, utterances, hit, known)


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return sum(known) / len(known) if known else None


def _overall(rows: list[VoiceFigures]) -> VoiceFigures:
    """The mean over registers of each figure (a register without a value, e.g. distinct-2 of a
    register with no valid reply, left out of that figure's mean); counts summed."""
    predicted: Counter[str] = Counter()
    for row in rows:
        predicted.update(row.predicted)
    means = {name: _mean([getattr(r, name) for r in rows]) for name in FIGURES}
    return VoiceFigures(
        register="all",
        turns=sum(r.turns for r in rows),
        valid=sum(r.valid for r in rows),
        **{**means, "schema_valid": means["schema_valid"] or 0.0},
        predicted=dict(sorted(predicted.items())),
        repeats=sum(r.repeats for r in rows),
    )


def heldout_summary(evaluation: dict[str, Any] | None) -> dict[str, Any] | None:
    """The headline of the register LoRAs' held-out loss matrix (an Evaluation.summary()):
    separability and mean gain, each register's base and own-adapter loss and margin."""
    if not evaluation:
        return None
    head = evaluation.get("headline", {"set": "r1", "tokens": "utterance"})
    scores = evaluation.get("scores", {}).get(head["set"], {}).get(head["tokens"])
    if not scores or not scores.get("registers"):
        return None
    return {
        "set": head["set"],
        "tokens": head["tokens"],
        "separability": scores["separability"]["value"],
        "mean_gain": scores["mean_gain"]["value"],
        "registers": {
            r: {
                "base": scores["matrix"][r]["base"]["loss"],
                "own": (scores["matrix"][r].get(r) or {}).get("loss"),
                "margin": (scores["margins"].get(r) or {}).get("value"),
                "n": scores["matrix"][r]["base"]["n"],
            }
            for r in scores["registers"]
        },
    }


# --- text ----------------------------------------------------------------------------------------

AGGREGATION = (
    "per reply over all turns (a reply that fails the schema: 0 English, not speaking, a miss); "
    "distinct-2 and words over the valid replies; overall: the mean over registers"
)
LABELS = {
    "schema_valid": "schema-valid",
    "english_rate": "English",
    "register_accuracy": "register accuracy",
    "distinct_2": "distinct-2",
}
PASS, FAIL = "pass", "FAIL"


def _f(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def with_interval(row: dict[str, Any], name: str, digits: int = 2) -> str:
    """``0.88 [0.75, 1.00]``: a figure and its scene-bootstrap interval (the figure alone without one)."""
    interval = (row.get("intervals") or {}).get(name)
    if interval is None or row.get(name) is None:
        return _f(row.get(name), digits)
    return f"{_f(row[name], digits)} [{interval[0]:.{digits}f}, {interval[1]:.{digits}f}]"


def confusion(predicted: dict[str, int]) -> str:
    """A row's labels, most frequent first: ``drunk-scavenger 5, none 2, invalid 1``."""
    return ", ".join(f"{k} {v}" for k, v in sorted(predicted.items(), key=lambda kv: (-kv[1], kv[0])))


def _check(goal: str, row: dict[str, Any], key: str, bar: float) -> dict[str, Any]:
    value = row.get(key)
    return {
        "goal": goal,
        "target": f">= {bar:.2f}",
        "value": value,
        "shown": with_interval(row, key),
        "passed": value is not None and value >= bar,
    }


def bar_checks(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The bar of a report's summary, one check per goal: :data:`GOALS` on the overall row,
    :data:`EACH_REGISTER` on every register, no reply repeating a sentence over the limit.
    ``passed`` is judged on the figure itself (one not measured fails); ``shown`` adds its interval."""
    goals, each = report.get("goals") or GOALS, report.get("each_register") or EACH_REGISTER
    overall, rows = report["overall"], report["registers"]
    checks = [_check(f"{LABELS.get(k, k)} (all registers)", overall, k, bar) for k, bar in goals.items()]
    for key, bar in each.items():
        checks += [_check(f"{LABELS.get(key, key)} ({r['register']})", r, key, bar) for r in rows]
    repeats, limit = overall.get("repeats"), report.get("repeat_limit", REPEAT_LIMIT)
    checks.append(
        {
            "goal": f"replies repeating a sentence more than {limit} times",
            "target": "= 0",
            "value": repeats,
            "shown": "n/a" if repeats is None else str(repeats),
            "passed": repeats == 0,
        }
    )
    return checks


def bar_lines(report: dict[str, Any], indent: str = "  ") -> list[str]:
    """The bar as lines: a verdict (the goals missed named), then each goal pass or FAIL."""
    checks = bar_checks(report)
    missed = [c["goal"] for c in checks if not c["passed"]]
    verdict = (
        f"every goal met ({len(checks)})"
        if not missed
        else f"{len(checks) - len(missed)} of {len(checks)} goals met; FAILS: {', '.join(missed)}"
    )
    return [f"{indent}bar: {verdict}"] + [
        f"{indent}  [{PASS if c['passed'] else FAIL}] {c['goal']}: {c['shown']} (goal {c['target']})"
        for c in checks
    ]


def interval_note(report: dict[str, Any]) -> str:
    """What the intervals rest on: the scenes resampled, or why there is none."""
    scenes = report.get("interval_scenes") or []
    if not report.get("bootstrap"):
        return (
            f"no interval: the turns span {len(scenes)} scene(s), fewer than the {MIN_SCENES} a "
            "scene bootstrap needs"
        )
    return (
        f"brackets: {report.get('confidence', CONFIDENCE):.0%} percentile intervals of a cluster "
        f"bootstrap over the {len(scenes)} scenes ({', '.join(scenes)}; {report['bootstrap']} "
        "resamples, every turn of a drawn scene)"
    )


def report_lines(report: dict[str, Any]) -> list[str]:
    """A report's summary as printable lines: one row per register (figures with their scene
    intervals), the bar, the labels each register got, the classifier and the held-out loss."""
    s = report["settings"]
    lines = [
        f"Voice report of {report['version'] or 'this version'} ({s.get('ring', 'ring A')}, "
        f"{s.get('turns_per_register')} turns per register on held-out scenes, at most "
        f"{s.get('max_new_tokens')} new tokens, seed {s.get('seed')}; {report['seconds']:.1f} s):",
        f"  {'register':<26} {'turns':>5} {'schema':>17} {'English':>17} {'reg.acc':>17} {'speaks':>7} "
        f"{'abstain':>8} {'copied':>7} {'dist-2':>17} {'words':>6} {'repeats':>7}",
    ]
    for row in [*report["registers"], report["overall"]]:
        lines.append(
            f"  {row['register']:<26} {row['turns']:>5} {with_interval(row, 'schema_valid'):>17} "
            f"{with_interval(row, 'english_rate'):>17} {with_interval(row, 'register_accuracy'):>17} "
            f"{_f(row['speaks']):>7} {_f(row['abstain_rate']):>8} {_f(row['copy_rate']):>7} "
            f"{with_interval(row, 'distinct_2'):>17} {_f(row['mean_words'], 1):>6} "
            f"{row.get('repeats', 'n/a'):>7}" + ("  (no valid reply)" if row["valid"] == 0 else "")
        )
    lines += [
        f"  {interval_note(report)}",
        *bar_lines(report),
        f"  chance {report['chance']:.2f}; copied {_f(report['overall']['copy_rate'])} (copies count "
        "as misses)",
        f"  figures: {AGGREGATION}",
        f"  held-out scenes: {', '.join(s.get('heldout_scenes') or []) or 'every scene'}; "
        f"{s.get('heldout_source', 'source not recorded')}"
        + (
            f"; eval-only scenes: {', '.join(s['eval_only_scenes'])} ({s.get('eval_only_source', '?')})"
            if s.get("eval_only_scenes")
            else ""
        ),
        f"  register classifier: {report['classifier']}",
    ]
    lines += [f"  labelled [{row['register']}]: {confusion(row['predicted'])}" for row in report["registers"]]
    loss = report.get("heldout_loss")
    if loss:
        lines.append(
            f"  held-out loss matrix (issue 4, {loss['set']} {loss['tokens']} tokens): separability "
            f"{_f(loss['separability'])}, mean gain over the base {_f(loss['mean_gain'], 3)} nats/token"
        )
    for row in report["registers"]:
        for sample in row["samples"][:1]:
            lines.append(f"  e.g. [{row['register']}] {sample[:120]!r}")
    return lines
