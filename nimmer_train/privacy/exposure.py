"""Record-level memorisation: Secret-Sharer exposure of planted text canaries (Carlini et al. 2019).

A canary is a training line with a random secret from a known format ("Wren's vault code is
4-8-1-5-2-7", a space of ``10^6`` secrets; each canary has its own owner); it is planted 1, 4 or
16 times among the training examples. After training, the model's log-perplexity of the canary
is ranked among ``M`` reference candidates: the same line with other random secrets of the
format. Exposure is ``log2(M) - log2(rank)`` (rank 1: the canary is the likeliest), at most
``log2(M)`` (13.3 bits for 10^4 references), and ``log2(e) = 1.44`` bits on average for a model
that learned nothing about the canary.

This module holds the canaries, the scoring and the arithmetic; the training it audits is the
federation's own (:func:`nimmer_train.federation.exposure_audit.canary_exposure` runs the A.2
node's DP-SGD and a non-DP control on the same data).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from nimmer_train.privacy.dp_sgd import per_record_loss

PLANTINGS = (1, 4, 16)  # times each canary is planted, as issue 14 asks
DIGITS = 6  # secret "d-d-d-d-d-d": 10^6 possible secrets
CHANCE_BITS = math.log2(math.e)
# invented owners: each canary's prefix differs from the others' by a whole word
OWNERS = (
    "Abel", "Brisk", "Corwin", "Dunya", "Emrys", "Fallon", "Gideon", "Hesper", "Ilka", "Jorah",
    "Kestrel", "Lumen", "Mireth", "Nadir", "Osric", "Pella", "Quill", "Rowan", "Sable", "Tamsin",
    "Ulric", "Vesna", "Wren", "Yarrow",
)  # fmt: skip  # mean exposure of a canary the model knows nothing about


@dataclass(frozen=True)
class Canary:
    prefix: str  # the format's fixed part, unique to this canary
    secret: tuple[int, ...]
    plantings: int

    @property
    def text(self) -> str:
        return line(self.prefix, self.secret)


def line(prefix: str, secret: Sequence[int]) -> str:
    return prefix + "-".join(str(d) for d in secret)


def make_canaries(
    per_count: int, rng: np.random.Generator, plantings: Sequence[int] = PLANTINGS
) -> list[Canary]:
    """``per_count`` canaries for every planting count, each with its own prefix and a random secret."""
    canaries: list[Canary] = []
    for count in plantings:
        for _ in range(per_count):
            n = len(canaries)
            name = OWNERS[n % len(OWNERS)] + (str(n // len(OWNERS)) if n >= len(OWNERS) else "")
            secret = tuple(int(d) for d in rng.integers(0, 10, DIGITS))
            canaries.append(Canary(f"{name}'s vault code is ", secret, count))
    return canaries


def plant(texts: Sequence[str], canaries: Sequence[Canary], rng: np.random.Generator) -> list[str]:
    """``texts`` with every canary added ``plantings`` times, in a random order."""
    planted = list(texts) + [c.text for c in canaries for _ in range(c.plantings)]
    return [planted[i] for i in rng.permutation(len(planted))]


def references(canary: Canary, count: int, rng: np.random.Generator) -> list[str]:
    """``count`` distinct candidates of the canary's format with other random secrets."""
    if count >= 10**DIGITS:
        raise ValueError(f"references: {count} candidates leave no room in a space of 10^{DIGITS} secrets")
    chosen: set[int] = set()
    secret = int("".join(map(str, canary.secret)))
    while len(chosen) < count:
        chosen.update(int(v) for v in rng.integers(0, 10**DIGITS, count - len(chosen)) if v != secret)
    return [line(canary.prefix, f"{v:0{DIGITS}d}") for v in sorted(chosen)]


@torch.no_grad()
def log_perplexities(
    model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, texts: Sequence[str], batch: int = 512
) -> np.ndarray:
    """Each text's log-perplexity (nats summed over its tokens, EOS included, as training encodes it)."""
    model.eval()
    out = np.empty(len(texts))
    for start in range(0, len(texts), batch):
        rows = [tokenizer(t)["input_ids"] + [tokenizer.eos_token_id] for t in texts[start : start + batch]]
        width = max(len(r) for r in rows)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
        target = torch.tensor([r[1:] + [-100] * (width - len(r)) for r in rows])
        logits = model(input_ids=ids).logits[:, :-1]
        valid = (target != -100).sum(dim=1)
        out[start : start + len(rows)] = (per_record_loss(logits, target) * valid).numpy()
    return out


def exposure(canary: float, reference: np.ndarray) -> float:
    """Secret-Sharer exposure in bits: log2(M) - log2(rank of the canary among the references)."""
    rank = 1 + int(np.sum(reference < canary))
    return math.log2(len(reference)) - math.log2(rank)


def canary_exposures(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    canaries: Sequence[Canary],
    candidates: Sequence[Sequence[str]],
) -> list[float]:
    """Each canary's exposure among its reference ``candidates`` (from :func:`references`), scored
    by ``model``."""
    values = []
    for canary, others in zip(canaries, candidates, strict=True):
        scores = log_perplexities(model, tokenizer, [canary.text, *others])
        values.append(exposure(scores[0], scores[1:]))
    return values


@dataclass(frozen=True)
class ExposureReport:
    """Exposures of the same canaries after DP training and after a non-DP control on the same data."""

    plantings: tuple[int, ...]  # per canary, in the order of the exposures
    dp: tuple[float, ...]
    control: tuple[float, ...]
    references: int  # M
    dp_epsilon: float | None  # record-level epsilon of the DP run at ``delta``
    delta: float
    settings: dict[str, object] = field(default_factory=dict)  # the training recipe of both runs

    def mean(self, which: str, up_to: int | None = None, exactly: int | None = None) -> float:
        """Mean exposure of the ``which`` run ("dp" or "control") over the canaries planted at most
        ``up_to`` times (or exactly ``exactly`` times; all without either)."""
        values = getattr(self, which)
        chosen = [
            v
            for v, n in zip(values, self.plantings, strict=True)
            if (up_to is None or n <= up_to) and (exactly is None or n == exactly)
        ]
        if not chosen:
            raise ValueError(f"no canary planted {up_to=} {exactly=} times in {sorted(set(self.plantings))}")
        return float(np.mean(chosen))

    def record(self) -> dict[str, object]:
        """Mean exposures per planting count for a privacy report or a benchmark."""
        counts = sorted(set(self.plantings))
        return {
            "method": "Secret-Sharer exposure (Carlini et al. 2019)",
            "references": self.references,
            "secret_space": 10**DIGITS,
            "chance_bits": CHANCE_BITS,
            "max_bits": math.log2(self.references),
            "dp_epsilon": self.dp_epsilon,
            "delta": self.delta,
            **{f"dp_exposure_{n}x": self.mean("dp", exactly=n) for n in counts},
            **{f"control_exposure_{n}x": self.mean("control", exactly=n) for n in counts},
            "canaries_per_count": len(self.plantings) // len(counts),
            **self.settings,
        }
