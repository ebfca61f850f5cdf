"""Ring A (and what ``nimmer serve`` runs): a verified version with every register LoRA that fits
it, one adapter per call, sampling knobs and optional schema-constrained decoding."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoTokenizer,
    LogitsProcessorList,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from nimmer_train.errors import NimmerError
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import VerifiedVersion, load_model, open_version
from nimmer_train.runtime.structured import SchemaMask, bounded
from nimmer_train.voice.sampling import SamplingKnobs


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    adapter: str | None  # the LoRA applied; None: the bare version


# Each ``generate`` argument of the knobs as the HF processor that applies it, in vLLM's order,
# with the test that leaves out a no-op value. The runtime applies the knobs itself, not through
# ``generate``'s own warpers, so that the schema mask can run before them (a token the grammar
# forbids must not take part in top-k / top-p / min-p).
_PROCESSORS: tuple[tuple[str, Callable[[Any], Any], Callable[[Any], bool]], ...] = (
    ("repetition_penalty", RepetitionPenaltyLogitsProcessor, lambda v: v != 1.0),
    ("temperature", TemperatureLogitsWarper, lambda v: True),
    ("top_k", TopKLogitsWarper, lambda v: v > 0),
    ("top_p", TopPLogitsWarper, lambda v: v < 1.0),
    ("min_p", MinPLogitsWarper, lambda v: v > 0),
)
# what ``generate`` itself is told: sample, with its own warpers neutral (the knobs are all in
# the processors, after the schema mask)
_NEUTRAL_WARPERS = {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}


def knob_processors(knobs: SamplingKnobs) -> LogitsProcessorList:
    """The knobs as HF processors, in vLLM's order: repetition penalty, temperature, top-k, top-p, min-p."""
    kwargs = knobs.generate_kwargs()
    return LogitsProcessorList(
        [make(kwargs[name]) for name, make, applies in _PROCESSORS if applies(kwargs[name])]
    )


class LocalModel:
    """One loaded version. ``generate`` is serialised (the active adapter is model-wide state)."""

    def __init__(self, version: VerifiedVersion, device: str = "cpu") -> None:
        self.version = version
        self.label = version.label
        self.model = load_model(version, device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(version.folder)
        self.registers = sorted(version.loras)
        merged = version.manifest.get("merged_adapter") or {}
        self.merged_register: str | None = merged.get("register")
        self.n_vocab = int(self.model.config.vocab_size)
        self.context_tokens = int(self.model.config.max_position_embeddings)
        self.device = device
        self._lock = threading.Lock()

    @classmethod
    def open(cls, releases: Path, name: str, trusted_keys: Path, device: str = "cpu") -> LocalModel:
        return cls(open_version(releases, name, Keyring.load(trusted_keys)), device)

    def adapter_for(self, register: str | None) -> str | None:
        """The LoRA that voices ``register`` on this version (None: the bare weights carry it)."""
        if register is None or register == self.merged_register:
            return None
        if register not in self.registers:
            raise NimmerError(
                f"no register LoRA {register!r} fits {self.label}; "
                f"fitting: {', '.join(self.registers) or 'none'}"
            )
        return register

    def generate(
        self,
        messages: list[dict[str, str]],
        register: str | None,
        knobs: SamplingKnobs,
        schema: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> Generation:
        adapter = self.adapter_for(register)
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        ids = (ids["input_ids"] if not isinstance(ids, torch.Tensor) else ids).to(self.device)
        processors = knob_processors(knobs)
        if schema is not None:
            mask = SchemaMask(
                self.tokenizer, bounded(schema, knobs.max_new_tokens), self.n_vocab, ids.shape[1]
            )
            processors.insert(0, mask)
        with self._lock:
            started = time.perf_counter()
            if seed is not None:
                torch.manual_seed(seed)
            out = self._generate(ids, adapter, processors, knobs.max_new_tokens)
            seconds = time.perf_counter() - started
        new = out[0, ids.shape[1] :]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(text, int(ids.shape[1]), int(new.shape[0]), seconds, adapter)

    def _generate(
        self, ids: torch.Tensor, adapter: str | None, processors: LogitsProcessorList, max_new: int
    ) -> torch.Tensor:
        kwargs = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "logits_processor": processors,
            **_NEUTRAL_WARPERS,
            "max_new_tokens": max_new,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.tokenizer.eos_token_id,
        }
        with torch.no_grad():
            if adapter is None and hasattr(self.model, "disable_adapter"):
                with self.model.disable_adapter():
                    return self.model.generate(**kwargs)
            if adapter is not None:
                self.model.set_adapter(adapter)
            return self.model.generate(**kwargs)
