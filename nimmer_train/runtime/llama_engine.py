"""One llama.cpp context over a GGUF base with its GGUF register LoRAs: token ids in, the next
token's logits out. Ring A's quantized path (:mod:`.quantized_model`) samples from those logits
itself, with the project's grammar mask and knobs, so that both engines decode by one rule.

One sequence at a time (a player talks to one NPC; llama.cpp's own batching of rows with
different LoRAs is what it lacks, and ``nimmer serve``'s torch engine keeps). The KV cache of the
last prompt is kept per LoRA: a next prompt with the same LoRA reuses its common prefix (the
system prompt and the knowledge stack change little between turns), even when turns under other
LoRAs came between (the context holds one LoRA's KV; the others' are parked as bytes, a few MB
each). Prefill is most of a quantized turn's time on one thread (165 prompt tokens: about 1.3 s
of a 1.8 s SmolLM2 Q4_1 turn, its decode steps 0.5 s), so reusing 145 of them is the big win."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.errors import NimmerError
from nimmer_train.publish.llama_binding import binding, lock
from nimmer_train.publish.quantize import REPACKED, file_type, read_base_key


def default_threads() -> int:
    """The cores this process may run on but one (``runtime.engine_threads: 0``; at least one):
    a player's one NPC turn at a time is latency-bound and llama.cpp splits each step over its
    threads, but they spin while they wait, so a thread that shares its core with other work (the
    game, here other jobs) stalls every step. Measured on this 2-core machine, Q4_1 SmolLM2 c=1
    turns at two threads over one: 1.68x slower at load 5, 8.3x at load 8-16."""
    return max(1, len(os.sched_getaffinity(0)) - 1)


class LlamaContext:
    """A loaded GGUF model, its context, and the LoRA adapters loaded onto it by register."""

    def __init__(self, gguf: Path, n_ctx: int = 4096, threads: int | None = None) -> None:
        lib, ffi = self.lib, self.ffi = binding()
        self.path, self.base_key, self.file_type = gguf, read_base_key(gguf), file_type(gguf)
        params = lib.llama_model_default_params()
        params.n_gpu_layers = 0
        params.use_mmap = True
        with lock():
            self.model = lib.llama_model_load_from_file(str(gguf).encode(), params)
        if self.model == ffi.NULL:
            raise NimmerError(f"{gguf}: llama.cpp could not load this GGUF; publish the version again")
        self.threads = threads or default_threads()
        cparams = lib.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = n_ctx  # a whole prompt in one decode call
        cparams.n_seq_max = 1
        cparams.n_threads = cparams.n_threads_batch = self.threads
        cparams.no_perf = True
        with lock():
            self.ctx = lib.llama_init_from_model(self.model, cparams)
        if self.ctx == ffi.NULL:
            lib.llama_model_free(self.model)
            raise NimmerError(f"{gguf}: llama.cpp could not make a context of {n_ctx} tokens")
        self.n_ctx = n_ctx
        self.n_vocab = int(lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(self.model)))
        self.adapters: dict[str, object] = {}
        self.cached: list[int] = []  # the tokens whose KV the context holds
        self.active: str | None = None  # the adapter those were computed with
        self.parked: dict[str | None, tuple[list[int], Any, int]] = {}  # other LoRAs' KV, as bytes
        self.park_kv = True  # False: a LoRA switch drops the KV (the benchmark's "before")
        self.mutex = threading.Lock()  # one sequence at a time

    def load_adapter(self, register: str, path: Path) -> None:
        """Load ``register``'s GGUF LoRA; one converted for another base is refused by name."""
        key = read_base_key(path)
        if key != self.base_key:
            raise NimmerError(
                f"{path.name}: LoRA converted for base {str(key)[:12]}..., not for this base "
                f"({str(self.base_key)[:12]}...); convert it from the LoRA trained on this version"
            )
        if self.file_type in REPACKED:  # a LoRA on repacked weights crashes this llama.cpp
            raise NimmerError(
                f"{self.path.name}: a LoRA cannot be applied to a Q4_0/Q4_K/IQ4_NL base with this "
                "llama.cpp (its repacked weights crash the LoRA loader); use the version's q4_1 or q8_0"
            )
        with lock():
            adapter = self.lib.llama_adapter_lora_init(self.model, str(path).encode())
        if adapter == self.ffi.NULL:
            raise NimmerError(f"{path}: llama.cpp refused this LoRA (its shapes do not fit the base)")
        self.adapters[register] = adapter

    def _use(self, register: str | None) -> None:
        """Switch the context to ``register``'s LoRA: the active one's KV parked, the new one's
        KV (from its last turn) restored, so its prompt prefix need not be decoded again."""
        if register == self.active:
            return
        if register is not None and register not in self.adapters:
            raise NimmerError(f"no GGUF LoRA for register {register!r}; loaded: {sorted(self.adapters)}")
        lib = self.lib
        self._park()
        lib.llama_kv_self_seq_rm(self.ctx, 0, -1, -1)  # (a clear zeroes the whole cache: 17 ms)
        lib.llama_clear_adapter_lora(self.ctx)
        if register is not None:
            lib.llama_set_adapter_lora(self.ctx, self.adapters[register], 1.0)
        self.active, self.cached = register, []
        parked = self.parked.pop(register, None)
        if parked is not None:
            tokens, data, size = parked
            if lib.llama_state_seq_set_data(self.ctx, data, size, 0) == size:
                self.cached = tokens
            else:  # not restorable: decoded again from the start
                lib.llama_kv_self_seq_rm(self.ctx, 0, -1, -1)

    def _park(self) -> None:
        """Keep the active LoRA's KV (sequence 0) as bytes until that LoRA speaks again."""
        if not (self.cached and self.park_kv):
            return
        lib, ffi = self.lib, self.ffi
        size = int(lib.llama_state_seq_get_size(self.ctx, 0))
        data = ffi.new("uint8_t[]", size)
        written = int(lib.llama_state_seq_get_data(self.ctx, data, size, 0))
        if written:
            self.parked[self.active] = (self.cached, data, written)

    def _decode(self, tokens: list[int]) -> np.ndarray:
        lib, ffi = self.lib, self.ffi
        if len(self.cached) + len(tokens) > self.n_ctx:
            raise NimmerError(
                f"{len(self.cached) + len(tokens)} tokens do not fit the {self.n_ctx}-token context"
            )
        buf = ffi.new("int32_t[]", tokens)
        rc = lib.llama_decode(self.ctx, lib.llama_batch_get_one(buf, len(tokens)))
        if rc != 0:
            self.cached = []
            lib.llama_kv_self_clear(self.ctx)
            raise NimmerError(f"llama_decode failed (code {rc})")
        self.cached.extend(tokens)
        out = lib.llama_get_logits_ith(self.ctx, -1)
        return np.frombuffer(ffi.buffer(out, self.n_vocab * 4), dtype=np.float32).copy()

    def prefill(self, prompt: list[int], register: str | None) -> np.ndarray:
        """The logits after ``prompt`` under ``register``'s LoRA, reusing the cached prefix."""
        self._use(register)
        common = 0
        for a, b in zip(self.cached, prompt, strict=False):
            if a != b:
                break
            common += 1
        common = min(common, len(prompt) - 1)  # at least one token is decoded for its logits
        if common < len(self.cached):
            self.lib.llama_kv_self_seq_rm(self.ctx, 0, common, -1)
            self.cached = self.cached[:common]
        return self._decode(prompt[common:])

    def step(self, token: int) -> np.ndarray:
        """The logits after one more token."""
        return self._decode([token])

    def token_losses(self, tokens: list[int], register: str | None) -> np.ndarray:
        """Teacher-forced: the loss (nats) of each token given those before it under
        ``register``'s LoRA, NaN at position 0 (as ``loras.train.token_losses`` places them), from
        one decode that keeps every position's logits. The KV cache is left empty (the next
        prompt is decoded whole)."""
        lib, ffi = self.lib, self.ffi
        n = len(tokens)
        if not 1 < n <= self.n_ctx:
            raise NimmerError(f"{n} tokens: teacher forcing needs 2 to {self.n_ctx}")
        self._use(register)
        lib.llama_kv_self_seq_rm(self.ctx, 0, -1, -1)
        self.cached = []
        batch = lib.llama_batch_init(n, 0, 1)
        try:
            for i, token in enumerate(tokens):
                batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, i, 1, 1
                batch.seq_id[i][0] = 0
            batch.n_tokens = n
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise NimmerError(f"llama_decode failed (code {rc})")
            out = lib.llama_get_logits(self.ctx)
            logits = np.frombuffer(ffi.buffer(out, n * self.n_vocab * 4), dtype=np.float32)
            logits = logits.reshape(n, self.n_vocab)[:-1].astype(np.float64)
        finally:
            lib.llama_batch_free(batch)
            lib.llama_kv_self_seq_rm(self.ctx, 0, -1, -1)
        top = logits.max(axis=1, keepdims=True)
        logz = (top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True)))[:, 0]
        picked = logits[np.arange(n - 1), tokens[1:]]
        return np.concatenate([[np.nan], logz - picked])

    def close(self) -> None:
        lib = self.lib
        with lock():
            for adapter in self.adapters.values():
                lib.llama_adapter_lora_free(adapter)
            self.adapters, self.parked = {}, {}
            if self.ctx is not None:
                lib.llama_free(self.ctx)
                lib.llama_model_free(self.model)
                self.ctx = self.model = None
