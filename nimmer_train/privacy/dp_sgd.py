"""DP-SGD for LoRA adapters with Opacus (record-level DP), the trainer the federated clients use.

Only the adapter is trainable, so only the LoRA layers need per-sample gradients. The model must
be on its device before the adapter is attached (a known Opacus + PEFT trap), embeddings stay
frozen, and :func:`lora_changed` checks after training that the adapter actually moved.

``grad_sample_mode``: "hooks" (per-sample gradients from module hooks) or "ghost" (Opacus ghost
clipping: two backward passes, no per-sample gradients kept; pays off in memory for big layers,
not in speed on small models). For "ghost" the loss goes through Opacus's criterion wrapper,
which needs the logits' shape to average token losses per sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from opacus import PrivacyEngine
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class DPConfig:
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "hooks"  # hooks | ghost
    poisson_sampling: bool = True


@dataclass
class PrivateTraining:
    model: torch.nn.Module
    optimizer: Any
    loader: DataLoader
    engine: PrivacyEngine
    criterion: Any | None  # the ghost-clipping loss wrapper, else None


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    settings: DPConfig,
    accountant_state: dict | None = None,
) -> PrivateTraining:
    """Wrap model, optimizer and loader for DP-SGD; ``accountant_state`` continues an earlier run."""
    engine = PrivacyEngine(accountant="rdp")
    if accountant_state:
        engine.accountant.load_state_dict(accountant_state)
    common = dict(
        module=model,
        optimizer=optimizer,
        data_loader=loader,
        noise_multiplier=settings.noise_multiplier,
        max_grad_norm=settings.max_grad_norm,
        poisson_sampling=settings.poisson_sampling,
        grad_sample_mode=settings.grad_sample_mode,
    )
    if settings.grad_sample_mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(
            criterion=torch.nn.CrossEntropyLoss(), **common
        )
        return PrivateTraining(model, optimizer, loader, engine, criterion)
    model, optimizer, loader = engine.make_private(**common)
    return PrivateTraining(model, optimizer, loader, engine, None)


def lm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, criterion: Any | None = None
) -> torch.Tensor:
    """Next-token cross-entropy (labels -100 are ignored), per-sample aware under ghost clipping."""
    logits = model(input_ids=input_ids).logits[:, :-1]
    target = labels[:, 1:]
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if criterion is not None:
        return criterion(flat_logits, flat_target, shape=logits.shape)
    return torch.nn.functional.cross_entropy(flat_logits, flat_target, ignore_index=-100)


def lora_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def lora_changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    """True if any LoRA weight moved since ``before`` (Opacus + PEFT can fail silently)."""
    after = {n.removeprefix("_module."): p for n, p in model.named_parameters() if "lora_" in n}
    return any(not torch.equal(before[n.removeprefix("_module.")], p) for n, p in after.items())
