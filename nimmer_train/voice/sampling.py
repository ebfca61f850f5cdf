"""Sampling knobs for one turn: temperature, top-p, top-k, repetition penalty, min-p, and the
no-repeat n-gram and sentence guards; a register's baseline and the bounds a director may move it within, side
by side; :func:`shape_knobs`, the one function that shapes a turn's knobs; and the knobs applied
as logits processors for the in-process decoders."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from nimmer_train.errors import NimmerError
from nimmer_train.voice.registers import RegistersConfig

if TYPE_CHECKING:  # transformers loads only when a decoder does
    from transformers import LogitsProcessorList

KNOBS = ("temperature", "top_p", "top_k", "repetition_penalty", "min_p")  # what a director may set
GUARDS = ("no_repeat_ngram_size", "max_sentence_repeats")  # the project's extensions: 0 is off
TEMPERATURE_RANGE, TOP_P_RANGE = (0.05, 2.0), (0.1, 1.0)  # what any turn's knobs are clamped into
TEMPERATURE_SPAN, TOP_P_SPAN = 0.3, 0.15  # how far a director may move them from the baseline


@dataclass(frozen=True)
class SamplingKnobs:
    temperature: float
    top_p: float
    top_k: int
    repetition_penalty: float
    min_p: float
    max_new_tokens: int = 160
    # no n-gram of this many of the reply's own tokens twice (0: off): at a register's low
    # temperature a real base otherwise loops ("The gate is closed. The gate is closed. ...")
    no_repeat_ngram_size: int = 0
    # no sentence said more than this many times in one reply (0: off): the n-gram guard misses
    # "Ha! Ha! You missed a coil. Ha!" (voice/sentence_guard.py)
    max_sentence_repeats: int = 0

    def as_dict(self) -> dict[str, float | int]:
        """The knobs (the two guards only when on: OpenAI's API has no such fields)."""
        out = asdict(self)
        for guard in GUARDS:
            if not out[guard]:
                del out[guard]
        return out

    def generate_kwargs(self) -> dict[str, bool | float | int]:
        """The knobs as transformers ``generate`` keyword arguments, sampling on. In-process
        decoders apply them through :func:`knob_processors` instead (generate's own repetition
        penalty counts the prompt). ``max_new_tokens`` is left to the caller: each bounds length
        its own way."""
        return {
            "do_sample": True,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "repetition_penalty": self.repetition_penalty,
            "min_p": self.min_p,
            **({"no_repeat_ngram_size": self.no_repeat_ngram_size} if self.no_repeat_ngram_size else {}),
        }


def baseline(catalogue: RegistersConfig, register: str) -> SamplingKnobs:
    """A register's baseline from the design's scene-to-sampling table (what the teacher is asked
    with, and what the replay set and the teacher cache are keyed on: no n-gram guard)."""
    reg = catalogue.get(register)
    level = catalogue.variety[reg.sampling.variety]
    return SamplingKnobs(
        reg.sampling.temperature, reg.sampling.top_p, level.top_k, level.repetition_penalty, level.min_p
    )


def from_traits(traits: dict[str, float]) -> tuple[float, float]:
    """(temperature, top_p) a trait vector implies on its own: restraint (Sophrosyne) cools and
    narrows, its absence heats and widens. Fitted to the design's table (caste-preacher
    Sophrosyne +0.8 -> 0.3 / 0.62, drunk-scavenger -0.8 -> 1.1 / 0.94)."""
    restraint = float(traits.get("Sophrosyne", 0.0))
    return 0.7 - 0.5 * restraint, 0.78 - 0.2 * restraint


def bounds(catalogue: RegistersConfig, register: str) -> dict[str, tuple[float, float]]:
    """The (low, high) a director may set each knob to for ``register`` (design: "Runtime sampling
    knobs", "per-turn director-controlled levers"): the baseline's temperature +-0.3 and top-p
    +-0.15, and top-k, repetition penalty (the teacher's and the turns') and min-p within the span
    of the register's variety level and its neighbours on the catalogue's variety ladder. The
    director shades a register's voice; it cannot make the hivemind sound like a drunk scavenger."""
    base = baseline(catalogue, register)
    ladder = sorted(catalogue.variety, key=lambda level: catalogue.variety[level].top_k)
    i = ladder.index(catalogue.get(register).sampling.variety)
    near = [catalogue.variety[level] for level in ladder[max(0, i - 1) : i + 2]]
    values = {k: [getattr(v, k) for v in near] for k in KNOBS[2:]}
    values["repetition_penalty"] += [v.turn_penalty for v in near]  # the teacher's and the turns'
    span = {k: (min(vs), max(vs)) for k, vs in values.items()}
    (t_low, t_high), (p_low, p_high) = TEMPERATURE_RANGE, TOP_P_RANGE
    return {
        "temperature": (
            max(t_low, base.temperature - TEMPERATURE_SPAN),
            min(t_high, base.temperature + TEMPERATURE_SPAN),
        ),
        "top_p": (max(p_low, base.top_p - TOP_P_SPAN), min(p_high, base.top_p + TOP_P_SPAN)),
        **span,
    }


class TurnKnobs(NamedTuple):
    """A turn's knobs, and what the director moved (``{knob: {"from": shaped, "to": directed}}``,
    the record the turn logs; empty when nothing was overridden)."""

    knobs: SamplingKnobs
    director_overrides: dict[str, dict[str, float]]


def shape_knobs(
    catalogue: RegistersConfig,
    register: str,
    traits: dict[str, float] | None = None,
    arousal: float = 0.5,
    valence: float = 0.0,
    director: Mapping[str, float] | None = None,
    max_new_tokens: int | None = None,
) -> TurnKnobs:
    """The knobs for one turn, the only place they are shaped: the register's row of the scene
    table, shifted by how far this NPC's trait vector sits from the register's profile, then
    modulated by affect (after mood: arousal heats and widens, up to +-20% temperature; distress
    (negative valence) discourages repetition), from the variety level's turn repetition penalty,
    with its no-repeat n-gram and sentence guards and the runtime's length cap (None: the knobs'
    default); last, the director's overrides, each within the register's :func:`bounds` (an
    unknown knob or a value outside them is refused, naming knob, value and bounds)."""
    knobs = baseline(catalogue, register)
    level = catalogue.variety[catalogue.get(register).sampling.variety]
    temperature, top_p = knobs.temperature, knobs.top_p
    if traits:
        own_t, own_p = from_traits(traits)
        reg_t, reg_p = from_traits(catalogue.get(register).traits)
        temperature, top_p = temperature + own_t - reg_t, top_p + own_p - reg_p
    temperature *= 1 + 0.4 * (arousal - 0.5)
    top_p += 0.1 * (arousal - 0.5)
    shaped = dataclasses.replace(
        knobs,
        temperature=round(_clamp(temperature, *TEMPERATURE_RANGE), 4),
        top_p=round(_clamp(top_p, *TOP_P_RANGE), 4),
        repetition_penalty=round(level.turn_penalty + 0.05 * max(0.0, -valence), 4),
        max_new_tokens=max_new_tokens or knobs.max_new_tokens,
        no_repeat_ngram_size=level.no_repeat_ngram_size,
        max_sentence_repeats=level.max_sentence_repeats,
    )
    if not director:
        return TurnKnobs(shaped, {})
    _check_director(catalogue, register, director)
    record = {knob: {"from": getattr(shaped, knob), "to": value} for knob, value in director.items()}
    typed = {k: int(v) if k == "top_k" else float(v) for k, v in director.items()}
    return TurnKnobs(dataclasses.replace(shaped, **typed), record)


def _check_director(catalogue: RegistersConfig, register: str, director: Mapping[str, float]) -> None:
    """Refuse an override of an unknown knob or one outside ``register``'s :func:`bounds`."""
    limits = bounds(catalogue, register)
    for knob, value in director.items():
        if knob not in KNOBS:
            raise NimmerError(f"director override {knob!r}: not a sampling knob; known: {', '.join(KNOBS)}")
        low, high = limits[knob]
        if not isinstance(value, int | float) or not low - 1e-9 <= value <= high + 1e-9:
            raise NimmerError(
                f"director override {knob}={value!r} is outside register {register!r}'s bounds "
                f"[{low:g}, {high:g}]; choose a value inside them or another register"
            )


def _clamp(value: float, low: float, high: float) -> float:
    return min(high, max(low, value))


# What ``generate`` itself is told when the knobs come as :func:`knob_processors`: sample, with its
# own warpers neutral (the knobs are all in the processors).
NEUTRAL_WARPERS: dict[str, bool | float | int] = {  # override a checkpoint's generation_config.json
    "do_sample": True,
    "temperature": 1.0,
    "top_k": 0,
    "top_p": 1.0,
    "repetition_penalty": 1.0,  # else generate() adds the config's own penalty, which counts the prompt
}


def repeated_ngram_bans(generated: list[int], n: int) -> set[int]:
    """The tokens that would complete an ``n``-gram already in ``generated`` (HF's
    ``no_repeat_ngram_size``, over the reply's own tokens only)."""
    if n <= 0 or len(generated) + 1 < n:
        return set()
    prefix = generated[len(generated) - n + 1 :] if n > 1 else []
    return {generated[i + n - 1] for i in range(len(generated) - n + 1) if generated[i : i + n - 1] == prefix}


def _ban(scores: Any, bans: list[set[int]]) -> Any:
    """``scores`` with row i's ``bans[i]`` at -inf, except in a row they would leave with no token
    at all (a grammar that allows only a banned token: the grammar wins, never an empty row)."""
    import torch

    mask = torch.zeros_like(scores, dtype=torch.bool)
    vocab = scores.shape[-1]
    for i, banned in enumerate(bans):
        inside = [t for t in banned if 0 <= t < vocab]  # an id past the scores has nothing to ban
        if inside:
            mask[i, inside] = True
    banned_scores = scores.masked_fill(mask, float("-inf"))
    alive = torch.isfinite(banned_scores).any(dim=-1, keepdim=True)
    return torch.where(alive, banned_scores, scores)


def _reply_ngram_processor(n: int, prompt_len: int) -> Any:
    from transformers import LogitsProcessor

    class NoRepeatReplyNGram(LogitsProcessor):
        """HF's no-repeat n-gram over the generated tokens only (never the prompt's)."""

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            generated = input_ids[:, prompt_len:].tolist()
            return _ban(scores, [repeated_ngram_bans(row, n) for row in generated])

    return NoRepeatReplyNGram()


def knob_processors(knobs: SamplingKnobs, prompt_len: int) -> LogitsProcessorList:
    """The knobs as HF logits processors in vLLM's order (repetition penalty, temperature, top-k,
    top-p, min-p), the no-repeat n-gram guard first, for every in-process decoder (the runtime,
    the LoRA evaluation's samples, the hf_local teacher); pass them as ``logits_processor``
    beside :data:`NEUTRAL_WARPERS`.

    The repetition penalty and the n-gram guard count only the generated tokens: the first
    ``prompt_len`` positions (the prompt, with the memory items and scene words an NPC should
    repeat) are never penalised. HF's ``generate`` and vLLM both count the prompt; a Ring B
    served by vLLM differs here (and has no n-gram guard). The sentence guard reads text, so only
    the runtime's engines hold it (they have the tokenizer): these decoders never get a turn's
    ``max_sentence_repeats``."""
    from transformers import (
        LogitsProcessorList,
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    processors: list[Any] = []
    if knobs.no_repeat_ngram_size > 0:
        processors.append(_reply_ngram_processor(int(knobs.no_repeat_ngram_size), prompt_len))
    if knobs.repetition_penalty != 1.0:
        penalty = float(knobs.repetition_penalty)
        processors.append(RepetitionPenaltyLogitsProcessor(penalty, prompt_ignore_length=prompt_len))
    processors.append(TemperatureLogitsWarper(float(knobs.temperature)))
    if knobs.top_k > 0:
        processors.append(TopKLogitsWarper(int(knobs.top_k)))
    if knobs.top_p < 1.0:
        processors.append(TopPLogitsWarper(float(knobs.top_p)))
    if knobs.min_p > 0:
        processors.append(MinPLogitsWarper(float(knobs.min_p)))
    return LogitsProcessorList(processors)


def warp_rows(
    scores: Any, knobs: list[SamplingKnobs], generated: list[list[int]], banned: list[set[int]] | None = None
) -> Any:
    """:func:`knob_processors` for a batch in which every row has its own knobs: ``scores``
    ``[B, V]`` (row i under ``knobs[i]``) processed in the same order and with the same results,
    the n-gram guard and the repetition penalty over ``generated[i]`` only (the row's own
    generated tokens: never the prompt, never another row's padding). ``banned[i]``: more tokens
    row i may not take, banned with the n-gram guard's (the sentence guard's, which needs the
    text: :mod:`.sentence_guard`). Rows whose knobs are neutral come back unchanged."""
    import torch

    rows, vocab = scores.shape
    bans = [repeated_ngram_bans(ids, k.no_repeat_ngram_size) for k, ids in zip(knobs, generated, strict=True)]
    if banned is not None:
        bans = [own | more for own, more in zip(bans, banned, strict=True)]
    if any(bans):
        scores = _ban(scores, bans)
    penalty = torch.tensor([k.repetition_penalty for k in knobs], dtype=scores.dtype)
    if bool((penalty != 1.0).any()) and any(generated):
        width = max(map(len, generated)) or 1
        ids = torch.full((rows, width), vocab, dtype=torch.long)  # padding points at a sink column
        for i, row in enumerate(generated):
            if row and knobs[i].repetition_penalty != 1.0:
                ids[i, : len(row)] = torch.tensor(row, dtype=torch.long).clamp(max=vocab)
        padded = torch.nn.functional.pad(scores, (0, 1))
        got = padded.gather(1, ids)
        hit = torch.where(got < 0, got * penalty[:, None], got / penalty[:, None])
        scores = _finite(padded.scatter(1, ids, hit)[:, :vocab])
    temperature = torch.tensor([k.temperature for k in knobs], dtype=scores.dtype)
    greedy = temperature <= 0
    if bool(greedy.any()):  # temperature 0: the row's most likely token (OpenAI's and vLLM's greedy)
        best = torch.zeros_like(scores, dtype=torch.bool).scatter_(
            1, scores.argmax(dim=-1, keepdim=True), True
        )
        scores = scores.masked_fill(greedy[:, None] & ~best, float("-inf"))
        temperature = torch.where(greedy, torch.ones_like(temperature), temperature)
    if bool((temperature != 1.0).any()):
        scores = _finite(scores / temperature[:, None])
    top_k = torch.tensor([min(k.top_k, vocab) if k.top_k > 0 else vocab for k in knobs])
    if bool((top_k < vocab).all()):  # every row keeps at most top_k: the rest runs on those only
        values, ids = scores.topk(int(top_k.max()), dim=-1)
        values = values.masked_fill(values < values.gather(1, (top_k - 1)[:, None]), float("-inf"))
        kept = _nucleus(values, knobs)
        return torch.full_like(scores, float("-inf")).scatter_(1, ids, kept)
    if bool((top_k < vocab).any()):
        threshold = scores.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1)[:, None])
        scores = scores.masked_fill(scores < threshold, float("-inf"))
    return _nucleus(scores, knobs)


def _nucleus(scores: Any, knobs: list[SamplingKnobs]) -> Any:
    """Top-p then min-p, each row under its own knobs (``scores`` may be each row's top-k
    candidates: a masked token's probability is zero either way)."""
    import torch

    top_p = torch.tensor([k.top_p for k in knobs], dtype=scores.dtype)
    if bool((top_p < 1.0).any()):
        ordered, order = torch.sort(scores, descending=False)
        remove = ordered.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
        remove[:, -1] = False
        scores = scores.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    min_p = torch.tensor([k.min_p for k in knobs], dtype=scores.dtype)
    if bool((min_p > 0).any()):
        probs = scores.softmax(dim=-1)
        remove = probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        remove.scatter_(1, probs.argmax(dim=-1, keepdim=True), False)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def _finite(scores: Any) -> Any:
    """``scores`` with NaN as -inf and +inf as the largest float: a knob that underflows float32
    (a repetition penalty or temperature of 1e-50 divides by zero) leaves its row's best tokens
    on top instead of a NaN that fails the draw of every row in the batch. -inf (masked) stays."""
    import torch

    top = torch.finfo(scores.dtype).max
    return torch.nan_to_num(scores, nan=float("-inf"), posinf=top, neginf=float("-inf"))


def sample_rows(scores: Any, generators: list[Any]) -> list[int]:
    """One token per row of ``scores`` ``[B, V]``, row i drawn with its own ``generators[i]``
    (a ``torch.Generator``): a seeded row draws the same token alone or inside any batch.
    Inverse-CDF draws, one uniform per row (``torch.multinomial`` took 0.12 ms per row on CPU,
    a tenth of a batch-8 decode step); the draw never lands on a token of probability zero."""
    import torch

    probs = scores.softmax(dim=-1)
    cdf = probs.cumsum(dim=-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=cdf.dtype) for g in generators])
    picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)  # each row's last possible
    return torch.minimum(picks, last).tolist()
