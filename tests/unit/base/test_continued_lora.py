"""Continued pretraining through a LoRA (model.continued_lora_rank): only the adapter trains, the
validation loss goes down, and the merged model is the adapted one with plain weights."""

from __future__ import annotations

import torch
from accelerate import Accelerator

from nimmer_train.base.modeling import build_model, count_parameters, merged, with_lora
from nimmer_train.base.pretrain import train
from nimmer_train.config import ModelConfig, TrainConfig


def test_a_lora_continues_pretraining_and_merges_into_plain_weights(tmp_path) -> None:
    base_cfg = ModelConfig(name="t", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    base_cfg.continued_lora_rank = 4
    model = build_model(base_cfg, 64, eos_id=0, pad_id=1, seed=0)
    frozen = {k: v.clone() for k, v in model.state_dict().items()}
    lora = with_lora(model, base_cfg)
    assert 0 < count_parameters(lora, trainable=True) < count_parameters(model) // 5

    blocks = torch.arange(32).repeat(40, 1)  # one pattern to learn
    cfg = TrainConfig(
        seq_len=32, micro_batch_size=4, max_steps=30, lr=1e-2, warmup_steps=2, eval_every=0, log_every=10
    )
    state = train(lora, blocks, blocks[:8], cfg, Accelerator(cpu=True), tmp_path / "ckpt")
    losses = [h["val_loss"] for h in state.history if "val_loss" in h]
    assert losses[-1] < losses[0] - 0.1

    lora.eval()
    x = blocks[:2]
    with torch.no_grad():
        adapted = lora(input_ids=x).logits
        plain = merged(lora)
        torch.testing.assert_close(plain(input_ids=x).logits, adapted, rtol=1e-4, atol=1e-4)
    assert set(plain.state_dict()) == set(frozen)  # no lora_* keys left
    assert any(not torch.equal(plain.state_dict()[k], frozen[k]) for k in frozen if "q_proj" in k)
