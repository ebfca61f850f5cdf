"""A tiny base that is a real (if small) language model: pretrained here for a few seconds on
public lines, so that a LoRA on top can learn, and memorise, within a test's budget. A randomly
initialised base cannot: its frozen, tiny embeddings bound every logit, and SGD on the adapter
barely moves the loss."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from nimmer_train.config import ModelConfig

MICRO = ModelConfig(
    name="micro",
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PUBLIC_OWNERS = ("Mara", "Oren", "Tess", "Ilse", "Dov")  # never a canary's owner


def public_lines(seed: int = 1) -> list[str]:
    """What the base learns from: the synthetic memory lines, and vault-code lines of the canaries'
    format for other owners (a real base knows what a code looks like, not whose it is)."""
    from nimmer_train.federation.client import example_text
    from nimmer_train.memory.synthetic import heldout_examples
    from nimmer_train.privacy.exposure import DIGITS, line

    rng = np.random.default_rng(seed)
    codes = [
        line(f"{rng.choice(PUBLIC_OWNERS)}'s vault code is ", rng.integers(0, 10, DIGITS))
        for _ in range(1000)
    ]
    return [example_text(e) for e in heldout_examples(2000, seed=seed)] + codes


def pretrain(model: torch.nn.Module, tokenizer, texts: list[str], steps: int, seed: int = 0) -> None:  # noqa: ANN001
    """AdamW next-token training of the whole base on random batches of ``texts``."""
    generator = torch.Generator().manual_seed(seed)
    rows = [tokenizer(t)["input_ids"][:47] + [tokenizer.eos_token_id] for t in texts]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [rows[i] for i in torch.randint(0, len(rows), (32,), generator=generator).tolist()]
        width = max(len(r) for r in batch)
        ids = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in batch])
        labels = torch.tensor([r + [-100] * (width - len(r)) for r in batch])
        model(input_ids=ids, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def pretrained_release(folder: Path, steps: int = 150) -> tuple[Path, Path]:
    """(base dir, adapter dir): the micro base pretrained on :func:`public_lines`, with a register
    adapter on every linear layer."""
    from tests.helpers.flower_deployment import tiny_release

    texts = public_lines()
    base, adapter, _ = tiny_release(
        folder, MICRO, ALL_LINEAR, prepare=lambda model, tokenizer: pretrain(model, tokenizer, texts, steps)
    )
    return base, adapter
