"""A torch Ring A whose logits the test chooses, so that an outcome does not hang on what a tiny
model happens to prefer: the prompt and the KV cache are still computed, only the scores the
sampler sees are replaced."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from nimmer_train.runtime.local_model import LocalModel


@contextmanager
def forced_logits(model: LocalModel, favour: dict[int, float]) -> Iterator[None]:
    """Every forward pass of ``model`` answers with ``favour`` (token -> logit), -1e4 elsewhere."""

    def hook(module, args, output):  # noqa: ANN001, ANN202
        forced = torch.full_like(output.logits, -1e4)
        for token, value in favour.items():
            forced[..., token] = value
        output.logits = forced
        return output

    inner = model.model.get_base_model() if hasattr(model.model, "get_base_model") else model.model
    handle = inner.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()
