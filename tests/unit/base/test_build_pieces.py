"""Small pieces of the base build: tokenizer, packing, schedule, data order."""

from __future__ import annotations

import numpy as np
import pytest

from nimmer_train.base.pretrain import batch_indices, lr_factor, pack_blocks
from nimmer_train.base.tokenizer import IM_END, train_bpe
from nimmer_train.config import TrainConfig

TEXTS = ["Françoise brought the madeleine. " * 20, "Socrates asked what justice is. " * 20] * 10


def test_tokenizer_special_tokens_and_assistant_mask() -> None:
    tok = train_bpe(TEXTS, vocab_size=400, model_max_length=128)
    assert tok.decode(tok("Françoise").input_ids) == "Françoise"
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token == "<|pad|>"
    messages = [
        {"role": "system", "content": "You are a scavenger."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Go away."},
    ]
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    spoken = [i for i, m in zip(out["input_ids"], out["assistant_masks"], strict=True) if m]
    assert tok.decode(spoken) == "Go away." + IM_END


def test_pack_blocks_joins_documents_with_eos() -> None:
    blocks = pack_blocks([[1, 2, 3], [4, 5]], eos_id=0, seq_len=3)
    assert blocks.tolist() == [[1, 2, 3], [0, 4, 5]]


def test_lr_warms_up_then_decays_to_floor() -> None:
    lrs = [lr_factor(s, warmup=10, total=100, min_ratio=0.1) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[100] == pytest.approx(0.1)


def test_batches_partition_each_epoch_across_ranks() -> None:
    cfg = TrainConfig(micro_batch_size=4, grad_accum_steps=2, max_steps=10, warmup_steps=1)
    n = 48  # one epoch = 3 steps of 16 blocks (2 ranks x 2 micro x 4)
    seen = [
        i
        for step in range(3)
        for micro in range(2)
        for rank in range(2)
        for i in batch_indices(step, micro, cfg, rank, 2, n)
    ]
    assert sorted(seen) == list(range(n))
    again = batch_indices(1, 1, cfg, 1, 2, n)
    assert np.array_equal(again, batch_indices(1, 1, cfg, 1, 2, n))
