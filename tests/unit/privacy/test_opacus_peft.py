"""Regression test for the silent Opacus + PEFT failure (Opacus issue 820: loss falls, epsilon
accrues, and the LoRA weights are never updated, or updated wrongly).

test_dp_sgd.py checks that the adapter moves over a noisy epoch, which the noise alone would do
even with the gradients lost. Here one DP-SGD step through the project's ``make_private`` runs
without noise and with a clipping norm no gradient reaches, so it must be exactly the plain SGD
step on the same batch: every LoRA tensor (lora_B set off zero first, as after any training, so
that lora_A gets a gradient too) moves, and lands where a non-private copy of the model puts it.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset

from nimmer_train.base.modeling import build_model
from nimmer_train.config import ModelConfig
from nimmer_train.privacy.dp_sgd import DPConfig, lm_loss, lora_snapshot, make_private

LR = 0.5


def _lora_model(device: str) -> torch.nn.Module:
    config = ModelConfig(
        name="tiny",
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    model = build_model(config, 256, 0, 1, seed=0).to(device)  # on its device before the adapter
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def _lora_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n.removeprefix("_module."): p.detach() for n, p in model.named_parameters() if "lora_" in n}


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["hooks", "ghost"])
def test_one_dp_sgd_step_moves_the_lora_weights_by_the_gradient(mode: str, device: str) -> None:
    warnings.filterwarnings("ignore")
    model = _lora_model(device)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # lora_B starts at zero, where lora_A gets no gradient: set it as after training
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, generator=generator))
    reference = copy.deepcopy(model)
    before = lora_snapshot(model)
    x = torch.randint(0, 256, (8, 12), generator=torch.Generator().manual_seed(1)).to(device)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    private = make_private(
        model,
        optimizer,
        DataLoader(TensorDataset(x), batch_size=8),
        DPConfig(noise_multiplier=0.0, max_grad_norm=1e6, grad_sample_mode=mode, poisson_sampling=False),
    )
    (batch,) = next(iter(private.loader))
    assert torch.equal(batch, x)  # one fixed batch, the whole dataset: the step is deterministic
    lm_loss(private.model, batch, batch, private.criterion).backward()
    private.optimizer.step()

    plain = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=LR)
    lm_loss(reference, x, x).backward()
    plain.step()

    after, expected = _lora_tensors(private.model), _lora_tensors(reference)
    assert after.keys() == expected.keys() == before.keys() and any("lora_B" in n for n in after)
    for name, value in after.items():
        assert not torch.equal(value, before[name]), f"{name} did not move in one DP-SGD step"
        torch.testing.assert_close(value, expected[name], rtol=1e-4, atol=1e-7, msg=f"{name}: not SGD's step")
