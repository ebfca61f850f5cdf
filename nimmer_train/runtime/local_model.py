"""Ring A (and what ``nimmer serve`` runs): a verified version with every register LoRA that fits
it, one adapter per call, sampling knobs and optional schema-constrained decoding."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

from nimmer_train.base.tokenizer import end_of_turn_ids
from nimmer_train.errors import NimmerError
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import VerifiedVersion, load_verified, open_version
from nimmer_train.runtime.structured import SchemaMask, bounded, chars_per_token
from nimmer_train.voice.sampling import NEUTRAL_WARPERS, SamplingKnobs, knob_processors


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    adapter: str | None  # the LoRA applied; None: the bare version


class LocalModel:
    """One loaded version. ``generate`` is serialised (the active adapter is model-wide state)."""

    def __init__(self, version: VerifiedVersion, device: str = "cpu") -> None:
        self.version = version
        self.label = version.label
        # both from one private copy whose bytes were hashed as read: what runs is what was verified
        self.model, self.tokenizer = load_verified(version, device=device)
        self.stop_ids = end_of_turn_ids(self.tokenizer)  # the chat template's end of turn, then EOS
        self.chars_per_token = chars_per_token(self.tokenizer)  # sizes the schema's string caps
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
        # the knobs as processors, after the schema mask (a token the grammar forbids takes no part
        # in top-k / top-p / min-p); the repetition penalty counts generated tokens only
        processors = knob_processors(knobs, ids.shape[1])
        if schema is not None:
            budget = knobs.max_new_tokens
            fitted = bounded(schema, budget, self.chars_per_token, self._count)
            processors.insert(0, SchemaMask(self.tokenizer, fitted, self.n_vocab, ids.shape[1], budget))
        with self._lock:
            started = time.perf_counter()
            if seed is not None:
                torch.manual_seed(seed)
            out = self._generate(ids, adapter, processors, knobs.max_new_tokens)
            seconds = time.perf_counter() - started
        new = out[0, ids.shape[1] :]
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(text, int(ids.shape[1]), int(new.shape[0]), seconds, adapter)

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def _generate(
        self, ids: torch.Tensor, adapter: str | None, processors: LogitsProcessorList, max_new: int
    ) -> torch.Tensor:
        kwargs = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "logits_processor": processors,
            **NEUTRAL_WARPERS,
            "max_new_tokens": max_new,
            "pad_token_id": self.tokenizer.pad_token_id,
            "eos_token_id": self.stop_ids,
        }
        with torch.no_grad():
            if adapter is None and hasattr(self.model, "disable_adapter"):
                with self.model.disable_adapter():
                    return self.model.generate(**kwargs)
            if adapter is not None:
                self.model.set_adapter(adapter)
            return self.model.generate(**kwargs)
