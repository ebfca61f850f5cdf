"""Secret-Sharer exposure of planted canaries: the arithmetic, and on a tiny pretrained model the A.2
node's own DP-SGD (train_locally at the public Poisson rate) against a non-DP control on the same
planted lines. Under DP the canaries planted up to 4 times stay near chance (<= 3 bits on average);
the control memorises (the canaries have power)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from nimmer_train.config.federated import LocalDPConfig, LocalRecipeConfig
from nimmer_train.federation.client import example_text
from nimmer_train.federation.exposure_audit import canary_exposure
from nimmer_train.federation.local_training import LocalTrainingConfig, load_trainable
from nimmer_train.memory.synthetic import heldout_examples
from nimmer_train.privacy.accounting import epsilon
from nimmer_train.privacy.dp_sgd import accounted_rate, public_sample_rate
from nimmer_train.privacy.exposure import (
    CHANCE_BITS,
    DIGITS,
    exposure,
    log_perplexities,
    make_canaries,
    plant,
    references,
)
from tests.helpers.tiny_lm import pretrained_release

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # Opacus's notes on secure RNG and alphas


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 64-wide model: threads only add overhead (and a shared CPU's waits)
    try:
        yield pretrained_release(tmp_path_factory.mktemp("canary-release"))
    finally:
        torch.set_num_threads(threads)


def test_exposure_is_log2_m_minus_log2_rank() -> None:
    refs = np.arange(1.0, 1001.0)  # 1000 references with log-perplexities 1..1000
    assert exposure(0.5, refs) == pytest.approx(math.log2(1000))  # the likeliest: rank 1
    assert exposure(10.5, refs) == pytest.approx(math.log2(1000) - math.log2(11))
    assert exposure(2000.0, refs) == pytest.approx(math.log2(1000) - math.log2(1001))
    # a canary the model knows nothing about: rank uniform, mean exposure about log2(e)
    rng = np.random.default_rng(0)
    chance = [exposure(rng.normal(), rng.normal(size=1000)) for _ in range(4000)]
    assert np.mean(chance) == pytest.approx(CHANCE_BITS, abs=0.1)


def test_exposure_is_log2_m_minus_log2_of_the_sorted_rank() -> None:
    rng = np.random.default_rng(4)
    reference = rng.normal(size=1024)
    for canary in (-9.0, reference[17], np.sort(reference)[511] + 1e-9, 9.0):
        rank = int(np.searchsorted(np.sort(reference), canary, side="left")) + 1
        assert exposure(float(canary), reference) == pytest.approx(10 - math.log2(rank))
    assert exposure(-9.0, reference) == pytest.approx(10.0)  # the likeliest: log2(M) bits


def test_canaries_are_planted_as_asked_and_their_references_share_the_format() -> None:
    rng = np.random.default_rng(0)
    canaries = make_canaries(3, rng)
    assert [c.plantings for c in canaries] == [1] * 3 + [4] * 3 + [16] * 3
    assert len({c.prefix for c in canaries}) == 9  # each its own owner
    texts = ["a line", "another line"]
    planted = Counter(plant(texts, canaries, rng))
    assert all(planted[c.text] == c.plantings for c in canaries) and planted["a line"] == 1
    refs = references(canaries[0], 500, rng)
    assert len(set(refs)) == 500 and canaries[0].text not in refs
    assert all(r.startswith(canaries[0].prefix) and len(r) == len(canaries[0].text) for r in refs)
    with pytest.raises(ValueError, match="references"):
        references(canaries[0], 10**DIGITS, rng)


def test_log_perplexity_is_the_models_summed_token_loss(release: tuple[Path, Path]) -> None:
    model, tokenizer = load_trainable(*release)
    texts = ["Mara's vault code is 1-2-3-4-5-6", "npc:warden-tess: the gate"]
    scores = log_perplexities(model, tokenizer, texts, batch=1)
    for text, score in zip(texts, scores, strict=True):
        ids = torch.tensor([tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]])
        with torch.no_grad():
            mean = model(input_ids=ids, labels=ids).loss.item()
        assert score == pytest.approx(mean * (ids.shape[1] - 1), rel=1e-5)
    padded = log_perplexities(model, tokenizer, texts)  # both in one padded batch: nothing changes
    assert np.allclose(padded, scores, rtol=1e-5)


def test_dp_keeps_canaries_near_chance_and_the_non_dp_control_memorises(release: tuple[Path, Path]) -> None:
    base, adapter = release
    pool = [example_text(e) for e in heldout_examples(16, seed=4)]  # the A.2 pool's training lines
    dp = LocalTrainingConfig(  # the A.2 node's recipe (FederatedConfig's DP-SGD defaults), longer
        LocalRecipeConfig(steps=125, batch_size=16, lr=3.0, max_length=48, max_examples=100),
        LocalDPConfig(noise_multiplier=1.0, max_grad_norm=0.1, grad_sample_mode="hooks"),
        seed=0,
        public_rate=True,
    )
    # the control: no noise, and a step well inside plain SGD's stable range (on this machine lr 2.0
    # already memorised less, about 4 bits at 16 plantings: CI once saw 4.7 at lr 1.0), trained
    # twice as long; it then memorises the 16-times-planted canaries to the top of the scale
    control = dataclasses.replace(
        dp,
        recipe=dataclasses.replace(dp.recipe, lr=0.5, steps=250),
        dp=dataclasses.replace(dp.dp, noise_multiplier=0.0, max_grad_norm=1.0),
    )
    report = canary_exposure(
        base, adapter, pool, dp, rounds=2, delta=1e-5, per_count=4, references=300,
        control=control, rng=np.random.default_rng(0),
    )  # fmt: skip
    figures = report.record()
    # the DP run is accounted as the node accounts it: 2 rounds of 125 steps at the public rate
    rate = accounted_rate(public_sample_rate(16, 100))
    assert report.dp_epsilon == pytest.approx(epsilon([(1.0, rate, 250)], 1e-5), rel=1e-6)
    assert report.mean("dp", up_to=4) <= 3.0, figures
    assert report.mean("control", exactly=16) >= 6.0, figures  # of at most log2(300) = 8.2 bits
    assert report.mean("control") >= report.mean("dp") + 1.0, figures
