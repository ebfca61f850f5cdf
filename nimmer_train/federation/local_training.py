"""Local DP-SGD on one contributor's examples: what an A.1 device and the server-operated A.2
client both run each round.

The base is loaded with the register adapter on top (trainable), the round's global LoRA tensors
are copied in, and Opacus trains the adapter for ``local.steps`` steps with Poisson sampling.
The noise and the Poisson masks come from generators seeded from the OS's entropy
(``dp_sgd.make_private``); the configured ``seed`` (the server sends it) seeds only what is not a
DP mechanism (dropout, if the adapter has any), so the server cannot recompute an update.
The accountant's state is read from and written back to a JSON file beside the data, so the
record-level epsilon of this contributor's data accumulates across rounds and restarts.

The A.2 pool's node trains with ``public_rate``: Poisson batches at ``batch_size / max_examples``
over every pooled example, the noisy sum divided by ``batch_size``, so neither its accounting
step (published through the A.2 epsilon) nor its update's scale depends on the pool's size, and
no example is left out because of the others (a cap on the examples would be). A device keeps
Opacus's rate, ``1 / len(loader)`` over its first ``max_examples`` examples: its size never
leaves it.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from peft import PeftModel
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.config.federated import LocalDPConfig, LocalRecipeConfig
from nimmer_train.errors import NimmerError
from nimmer_train.federation.wire import get_arrays, set_arrays, spec_of
from nimmer_train.loras.adapters import load_base
from nimmer_train.loras.train import compute_autocast
from nimmer_train.privacy.accounting import epsilon
from nimmer_train.privacy.dp_sgd import (
    DPConfig,
    empty_batch_step,
    lm_loss,
    lora_changed,
    lora_snapshot,
    make_private,
    public_sample_rate,
)


@dataclass(frozen=True)
class LocalTrainingConfig:
    """One node's training this round: the recipe and DP-SGD the server sends in its fit config
    (the ``local`` and ``local_dp`` groups, read whole), and what the node decides itself."""

    recipe: LocalRecipeConfig
    dp: LocalDPConfig
    seed: int  # the federation's seed + the round: data order and initialisation, never DP noise
    public_rate: bool = False  # the A.2 pool: a rate and divisor that do not depend on its size
    private: bool = True  # local DP-SGD; False: plain local SGD (local_dp.on_devices=false, A.1 only)

    @classmethod
    def from_fit_config(cls, config: Mapping[str, Any], pool: bool) -> LocalTrainingConfig:
        """What a node (``pool``: the server-operated A.2 client) trains with, from the fit config.
        The pool always trains with DP-SGD (its record-level guarantee); a device unless the
        federation relies on the user-level mechanism alone."""
        dp = LocalDPConfig.from_fit_config(config)
        return cls(
            LocalRecipeConfig.from_fit_config(config),
            dp,
            seed=int(config["seed"]) + int(config["round"]),
            public_rate=pool,  # the pool's size stays out of its accounting
            private=pool or dp.on_devices,
        )


@dataclass(frozen=True)
class LocalResult:
    arrays: list[np.ndarray]
    examples: int
    steps: int  # accountant steps taken (Poisson batches, empty ones included)
    sample_rate: float
    epsilon: float | None  # this contributor's record-level epsilon so far (None: no noise)


def encode_rows(
    tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int
) -> list[dict[str, list[int]]]:
    """Token ids ending in EOS, with every token a label (the rows train_loras.heldout_loss reads)."""
    rows = [tokenizer(t)["input_ids"][: max_length - 1] + [tokenizer.eos_token_id] for t in texts]
    return [{"input_ids": r, "labels": r} for r in rows]


def encode(tokenizer: PreTrainedTokenizerBase, texts: list[str], max_length: int) -> TensorDataset:
    """Right-padded token ids and labels (pads are -100), one row per text, ending in EOS."""
    rows = [r["input_ids"] for r in encode_rows(tokenizer, texts, max_length)]
    width = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (width - len(r)) for r in rows])
    labels = torch.tensor([r + [-100] * (width - len(r)) for r in rows])
    return TensorDataset(ids, labels)


def load_trainable(base_dir: Path, adapter_dir: Path) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """The base (on its device first, as Opacus + PEFT need) with the adapter trainable on top."""
    model = PeftModel.from_pretrained(load_base(base_dir), adapter_dir, is_trainable=True)
    return model, AutoTokenizer.from_pretrained(base_dir)


_LOADED: dict[tuple[Any, ...], tuple[PeftModel, PreTrainedTokenizerBase]] = {}


def reusable_trainable(base_dir: Path, adapter_dir: Path) -> tuple[PeftModel, PreTrainedTokenizerBase]:
    """:func:`load_trainable`, kept for the next call on the same folders (path, inode, size and
    mtime of each folder and its files; one entry): a simulation's process hosts many nodes,
    and loading the base was most of a small adapter's node. Only for plain SGD, which sets every
    trainable weight from the round's arrays before its first step (:func:`sgd_locally`)."""
    stats = [(f, f.stat()) for d in (base_dir, adapter_dir) for f in (d, *sorted(d.iterdir()))]
    key = tuple((str(f), st.st_ino, st.st_size, st.st_mtime_ns) for f, st in stats)
    if key not in _LOADED:
        _LOADED.clear()
        _LOADED[key] = load_trainable(base_dir, adapter_dir)
    return _LOADED[key]


def train_locally(
    base_dir: Path,
    adapter_dir: Path,
    arrays: list[np.ndarray],
    texts: list[str],
    settings: LocalTrainingConfig,
    accountant_file: Path,
    delta: float,
    spec_digest: str | None = None,
) -> LocalResult:
    """DP-SGD on ``texts`` starting from the global ``arrays``; no texts: the arrays unchanged.
    ``spec_digest`` (the server's) must match this node's adapter: same tensor names and shapes."""
    if not texts:
        return LocalResult(arrays, 0, 0, 0.0, _saved_epsilon(accountant_file, delta))
    # Opacus wraps the model it trains, so a private node loads its own; plain SGD overwrites the
    # adapter from ``arrays`` first, so one loaded model serves every node a process hosts
    model, tokenizer = (load_trainable if settings.private else reusable_trainable)(base_dir, adapter_dir)
    if spec_digest is not None and spec_of(model).digest != spec_digest:
        raise NimmerError(
            f"the adapter at {adapter_dir} ({spec_of(model).digest}) is not the one the server federates "
            f"({spec_digest}): install the release the federation names"
        )
    if not settings.private:
        trained, steps = sgd_locally(model, tokenizer, arrays, texts, settings)
        return LocalResult(trained, min(len(texts), settings.recipe.max_examples), steps, 0.0, None)
    set_arrays(model, arrays)
    model.train()
    dp = DPConfig(settings.dp.noise_multiplier, settings.dp.max_grad_norm, settings.dp.grad_sample_mode)
    if settings.public_rate:  # every example; rate and divisor from the settings only
        q = public_sample_rate(settings.recipe.batch_size, settings.recipe.max_examples)
        dp = dataclasses.replace(dp, sample_rate=q, expected_batch_size=settings.recipe.batch_size)
    else:
        texts = texts[: settings.recipe.max_examples]
    data = encode(tokenizer, texts, settings.recipe.max_length)
    batch = min(settings.recipe.batch_size, len(texts))
    torch.manual_seed(settings.seed)  # not the DP noise nor the Poisson masks: see make_private
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=settings.recipe.lr)
    state = json.loads(accountant_file.read_text()) if accountant_file.exists() else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Opacus's notes on secure RNG and optimizer wrapping
        private = make_private(model, optimizer, DataLoader(data, batch_size=batch), dp, state)
    rate = 1 / len(private.loader)
    before = lora_snapshot(model)
    steps = 0
    while steps < settings.recipe.steps:
        for ids, labels in private.loader:
            if len(ids):
                lm_loss(private.model, ids, labels, private.criterion).backward()
                private.optimizer.step()
                private.optimizer.zero_grad()
            else:  # an empty Poisson batch: the noise-only step, accounted (the model needs rows)
                empty_batch_step(private)
            steps += 1
            if steps == settings.recipe.steps:
                break
    if not lora_changed(private.model, before):
        raise NimmerError("local DP-SGD left the LoRA weights unchanged (Opacus + PEFT wiring)")
    accountant = private.engine.accountant
    write_json_atomic(accountant_file, {"history": accountant.history, "mechanism": accountant.mechanism()})
    return LocalResult(
        get_arrays(private.model), len(texts), steps, rate, float(accountant.get_epsilon(delta=delta))
    )


def sgd_locally(
    model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    arrays: list[np.ndarray],
    texts: list[str],
    settings: LocalTrainingConfig,
) -> tuple[list[np.ndarray], int]:
    """Plain local SGD from the global ``arrays`` (no record-level noise: the user-level mechanism
    protects the whole update): ``recipe.steps`` steps on consecutive batches of ``batch_size`` of
    the first ``max_examples`` texts, cycling; deterministic given ``settings.seed``. The Flower
    client and the sweep simulator (:mod:`nimmer_train.federation.simulator`, one loaded model
    for every contributor) both train with this. Returns (trained arrays, steps)."""
    set_arrays(model, arrays)
    model.zero_grad(set_to_none=True)  # a shared model: a node that failed mid-step left its gradients
    model.train()
    texts = texts[: settings.recipe.max_examples]
    data = encode(tokenizer, texts, settings.recipe.max_length)
    size = min(settings.recipe.batch_size, len(texts))
    torch.manual_seed(settings.seed)  # dropout, if the adapter has any
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=settings.recipe.lr)
    for step in range(settings.recipe.steps):
        rows = [(step * size + j) % len(texts) for j in range(size)]
        ids, labels = data[rows]
        with compute_autocast(model, settings.recipe.dtype):
            loss = lm_loss(model, ids, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return get_arrays(model), settings.recipe.steps


def _saved_epsilon(accountant_file: Path, delta: float) -> float | None:
    if not accountant_file.exists():
        return 0.0
    return epsilon([tuple(h) for h in json.loads(accountant_file.read_text())["history"]], delta)
