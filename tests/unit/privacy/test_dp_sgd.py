"""DP-SGD on a LoRA adapter: the adapter moves, and the accountant's state carries across runs
(a federated client trains once per round)."""

from __future__ import annotations

import warnings

import pytest
import torch
from opacus.accountants import RDPAccountant
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from nimmer_train.base.modeling import build_model
from nimmer_train.config import ModelConfig
from nimmer_train.privacy.dp_sgd import DPConfig, lm_loss, lora_changed, lora_snapshot, make_private


def _round(state: dict | None, mode: str = "hooks") -> tuple[bool, dict, float]:
    model = build_model(
        ModelConfig(
            name="tiny",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
        256,
        0,
        1,
        seed=0,
    )
    model = get_peft_model(
        model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    before = lora_snapshot(model)
    data = TensorDataset(torch.randint(0, 256, (64, 16), generator=torch.Generator().manual_seed(1)))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    private = make_private(
        model,
        optimizer,
        DataLoader(data, batch_size=16),
        DPConfig(noise_multiplier=1.2, grad_sample_mode=mode),
        accountant_state=state,
    )
    for (x,) in private.loader:
        if len(x):
            lm_loss(private.model, x, x, private.criterion).backward()
            private.optimizer.step()
            private.optimizer.zero_grad()
    return (
        lora_changed(private.model, before),
        private.engine.accountant.state_dict(),
        private.engine.get_epsilon(1e-5),
    )


@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_dp_lora_moves_and_accounting_persists(mode: str) -> None:
    warnings.filterwarnings("ignore")
    changed, state, eps_one = _round(None, mode)
    assert changed and eps_one > 0
    _, _, eps_two = _round(state, mode)
    independent = RDPAccountant()
    for _ in range(2 * 4):  # two rounds of 64 / 16 = 4 steps at sample rate 1/4
        independent.step(noise_multiplier=1.2, sample_rate=0.25)
    assert eps_two == pytest.approx(independent.get_epsilon(delta=1e-5), rel=1e-6) and eps_two > eps_one
