"""DP-SGD for LoRA adapters with Opacus (record-level DP), the trainer the federated clients use.

Only the adapter is trainable, so only the LoRA layers need per-sample gradients. The model must
be on its device before the adapter is attached (a known Opacus + PEFT trap), embeddings stay
frozen, and :func:`lora_changed` checks after training that the adapter actually moved.

``grad_sample_mode``: "hooks" (per-sample gradients from module hooks) or "ghost" (Opacus ghost
clipping: two backward passes, no per-sample gradients kept; pays off in memory for big layers,
not in speed on small models). For "ghost" the loss goes through Opacus's criterion wrapper,
which needs the logits' shape to average token losses per sample.

The privacy unit is one record (one sequence): :func:`lm_loss` averages token losses within each
record first, then across the batch, in both modes, so a record's per-sample gradient (and so its
clipped contribution) never depends on the other records' lengths.

Randomness: the Gaussian noise and the Poisson sampling masks come from generators seeded from
the OS's entropy (:func:`entropy_generator`), never from ``torch.manual_seed``: a configured
seed (which the federation's server chooses) may drive data order and initialisation only.
Opacus's ``secure_mode`` would use torchcsprng, which is not available for this torch; the
generators here are torch's Mersenne Twister with a fresh 64-bit seed from ``os.urandom``.

Empty Poisson batches: the model cannot run on zero rows, so :func:`empty_batch_step` takes the
step Opacus's optimizer would take (a clipped sum of 0 plus the noise, accounted): skipping it
would leave the weights unmoved exactly when the batch is empty, which the noise would not hide.

Dataset size: by default Opacus samples at ``1 / len(loader)`` and divides the noisy sum by
``int(len(dataset) * rate)``, both functions of the dataset's size. Where that size is private
(the A.2 pool, whose epsilon is published), ``DPConfig.sample_rate`` and
``DPConfig.expected_batch_size`` fix both from public settings instead.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.data_loader import DPDataLoader
from opacus.optimizers.optimizer import _generate_noise
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class DPConfig:
    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    grad_sample_mode: str = "hooks"  # hooks | ghost
    poisson_sampling: bool = True
    # a public Poisson rate over the whole dataset and a public divisor of the noisy sum (None:
    # Opacus's 1 / len(loader) and int(len(dataset) * rate), which depend on the dataset's size)
    sample_rate: float | None = None
    expected_batch_size: int | None = None


@dataclass
class PrivateTraining:
    model: torch.nn.Module
    optimizer: Any
    loader: DataLoader
    engine: PrivacyEngine
    criterion: Any | None  # the ghost-clipping loss wrapper, else None


def entropy_generator() -> torch.Generator:
    """A torch generator seeded from the OS's entropy (64 bits of ``os.urandom``): what every
    noise draw and sampling mask of a DP mechanism uses."""
    return torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little"))


def opacus_sample_rate(examples: int, batch_size: int) -> float:
    """The sampling rate Opacus accounts for ``examples`` in Poisson batches of ``batch_size``:
    ``1 / len(DPDataLoader)``, where the loader has ``int(1 / (1 / batches))`` batches
    (batches = ceil(examples / batch_size)); that is batches - 1 for some counts (93 -> 92),
    so a plan must use this, not 1 / batches."""
    batches = -(-examples // min(batch_size, examples))
    return accounted_rate(1 / batches)


def accounted_rate(sample_rate: float) -> float:
    """The rate Opacus accounts for Poisson batches drawn at ``sample_rate``: ``1 / len(loader)``
    with ``int(1 / sample_rate)`` batches, so at least ``sample_rate`` (93 batches: 1/92)."""
    return 1 / int(1 / sample_rate)


def public_sample_rate(batch_size: int, max_examples: int) -> float:
    """A Poisson rate that depends on settings only: ``batch_size`` expected examples per batch
    from a dataset of ``max_examples`` (the A.2 pool's rate, whatever the pool's size)."""
    return min(1.0, batch_size / max_examples)


def make_private(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: DataLoader,
    settings: DPConfig,
    accountant_state: dict | None = None,
) -> PrivateTraining:
    """Wrap model, optimizer and loader for DP-SGD; ``accountant_state`` continues an earlier run.

    The noise and the Poisson masks draw from two fresh :func:`entropy_generator`s (the loader is
    rebuilt over the same dataset with its own generator, which Opacus's DPDataLoader inherits)."""
    engine = PrivacyEngine(accountant="rdp")
    if accountant_state:
        engine.accountant.load_state_dict(accountant_state)
    if settings.sample_rate is not None:  # Poisson at a public rate: Opacus keeps this loader
        sampled: DataLoader = DPDataLoader(
            loader.dataset,
            sample_rate=settings.sample_rate,
            collate_fn=loader.collate_fn,
            generator=entropy_generator(),
        )
    else:
        sampled = DataLoader(
            loader.dataset,
            batch_size=loader.batch_size,
            collate_fn=loader.collate_fn,
            generator=entropy_generator(),
        )
    common = dict(
        module=model,
        optimizer=optimizer,
        data_loader=sampled,
        noise_multiplier=settings.noise_multiplier,
        max_grad_norm=settings.max_grad_norm,
        poisson_sampling=settings.poisson_sampling and settings.sample_rate is None,
        grad_sample_mode=settings.grad_sample_mode,
        noise_generator=entropy_generator(),
    )
    criterion = None
    if settings.grad_sample_mode == "ghost":
        model, optimizer, criterion, loader = engine.make_private(
            criterion=torch.nn.CrossEntropyLoss(), **common
        )
    else:
        model, optimizer, loader = engine.make_private(**common)
    if settings.expected_batch_size is not None:  # the noisy sum's divisor, not int(len(dataset) * rate)
        optimizer.expected_batch_size = settings.expected_batch_size
    return PrivateTraining(model, optimizer, loader, engine, criterion)


def empty_batch_step(private: PrivateTraining) -> None:
    """The DP-SGD step on an empty Poisson batch, as Opacus's optimizer takes it for a model that
    can run on zero rows: the clipped sum is 0, the Gaussian noise is added, divided by the
    expected batch size and applied, and the step is accounted at the loader's rate."""
    optimizer = private.optimizer
    std = optimizer.noise_multiplier * optimizer.max_grad_norm
    for p in optimizer.params:
        noise = _generate_noise(std, p, optimizer.generator, optimizer.secure_mode)
        p.grad = noise / optimizer.expected_batch_size  # loss_reduction "mean", as make_private uses
    optimizer.original_optimizer.step()
    optimizer.zero_grad()
    private.engine.accountant.step(
        noise_multiplier=optimizer.noise_multiplier, sample_rate=1 / len(private.loader)
    )


def lm_loss(
    model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor, criterion: Any | None = None
) -> torch.Tensor:
    """Next-token cross-entropy (labels -100 are ignored), averaged over each record's valid tokens
    first and then over the records of the batch.

    Opacus's "mean" reduction multiplies each per-sample gradient by the batch size B, which
    undoes exactly the 1/B of the batch mean: record i's per-sample gradient is then the gradient
    of its own token mean, whatever the other records hold. (A token mean over the whole batch,
    T valid tokens, would scale it by B/T instead: record i's clipped contribution would change
    with the other records' lengths.) Under ghost clipping Opacus's criterion wrapper computes the
    same per-record token mean (``shape`` and the criterion's ignore_index)."""
    logits = model(input_ids=input_ids).logits[:, :-1]
    target = labels[:, 1:]
    flat_logits, flat_target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    if criterion is not None:
        return criterion(flat_logits, flat_target, shape=logits.shape)
    return per_record_loss(logits, target).mean()


def per_record_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Each record's mean token cross-entropy over its valid (not -100) targets, shape (B,)."""
    tokens = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100, reduction="none"
    ).view(target.shape)
    valid = (target != -100).sum(dim=1).clamp(min=1)
    return tokens.sum(dim=1) / valid


def lora_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def lora_changed(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    """True if any LoRA weight moved since ``before`` (Opacus + PEFT can fail silently)."""
    after = {n.removeprefix("_module."): p for n, p in model.named_parameters() if "lora_" in n}
    return any(not torch.equal(before[n.removeprefix("_module.")], p) for n, p in after.items())
