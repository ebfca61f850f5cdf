"""Ring A (and what ``nimmer serve`` runs): a verified version with every register LoRA that fits
it, served by one batching :class:`~nimmer_train.runtime.engine.Engine` (each request its own
adapter, knobs, seed and schema), with adapters loaded and unloaded at run time only as the
signed version registry allows."""

from __future__ import annotations

import dataclasses
import logging
import queue
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from nimmer_train.artifacts import merged_voice
from nimmer_train.errors import NimmerError
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import CompatibilityError, VerifiedVersion, load_verified, open_version
from nimmer_train.runtime.decode_attention import use_decode_attention
from nimmer_train.runtime.engine import Delta, Done, Engine, Event, Failed, Job, random_seed
from nimmer_train.runtime.packed_linear import pack_linears
from nimmer_train.voice.sampling import SamplingKnobs
from nimmer_train.voice.structured import RowGrammar, bounded, chars_per_token, end_of_turn_ids

log = logging.getLogger(__name__)


class AdapterBusy(NimmerError):
    """A register's LoRA cannot be unloaded while a running or waiting request uses it."""


@dataclass(frozen=True)
class Generation:
    text: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    adapter: str | None  # the LoRA applied; None: the bare version
    finish_reason: str = "stop"  # stop | length


@dataclass(frozen=True)
class EngineSettings:
    max_batch: int = 16  # rows decoded together
    window_s: float = 0.004  # an idle engine waits this long for company before a prefill
    max_waiting: int = 64  # rows queued beyond the batch (then 429 with Retry-After)
    threads: int = 1  # torch intra-op threads of the decode thread (more on a free many-core host)
    prefix_cache_entries: int = 32  # recent prompts whose KV a new prompt's common prefix reuses
    stream_interval: int = 4  # a streamed row's text is sent every this many tokens (its first at once)
    dtype: str = "float32"  # float32 | bfloat16 | auto (bfloat16 where the device multiplies it natively)


DTYPES = ("float32", "bfloat16", "auto")


def native_bf16(device: str) -> bool:
    """Whether ``device`` multiplies bfloat16 natively: a CUDA GPU that supports it, or a CPU with
    AMX tiles or AVX512-BF16 (elsewhere bfloat16 matmuls are emulated and slower than float32)."""
    if device.startswith("cuda"):
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    probes = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")  # torch.cpu's own checks
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def serving_dtype(name: str, device: str) -> Any:
    """The torch dtype ``EngineSettings.dtype`` names on ``device``. Weights are published in
    float32; bfloat16 halves what a decode step reads (on this AVX512-BF16 CPU, SmolLM2-135M with
    its register LoRAs: about 29 ms a step against 34-37 at one row, 48 against 68 at 8). A seeded
    row may then draw differently alone and in a batch (bfloat16 rounding depends on the rows
    around it), so float32 stays the default."""
    if name not in DTYPES:
        raise NimmerError(f"engine dtype {name!r}: use one of {', '.join(DTYPES)}")
    if name == "auto":
        return torch.bfloat16 if native_bf16(device) else torch.float32
    if name == "bfloat16" and not native_bf16(device):
        log.warning("%s has no native bfloat16 matmul: decoding will be slower than float32", device)
    return torch.bfloat16 if name == "bfloat16" else torch.float32


class VersionSpeaker:
    """What Ring A's two engines share: the register a LoRA voices, the chat template applied,
    special tokens taken out of the player's text. A subclass sets ``tokenizer``, ``label``,
    ``registers`` and ``merged_register``."""

    tokenizer: Any
    label: str
    registers: list[str]
    merged_register: str | None
    n_vocab: int

    def speak_with(self, version: VerifiedVersion, tokenizer: Any) -> None:
        """What both engines read from the version and its tokenizer."""
        self.version, self.label, self.tokenizer = version, version.label, tokenizer
        self.stop_ids = end_of_turn_ids(tokenizer)  # the chat template's end of turn, then EOS
        self.chars_per_token = chars_per_token(tokenizer)  # sizes the schema's string caps
        self.merged_register: str | None = merged_voice(version.manifest.get("merged_adapter"))

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

    def prompt_ids(self, messages: list[dict[str, str]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @property
    def special_tokens(self) -> tuple[str, ...]:
        """The tokenizer's special tokens (``<|im_end|>``...): never allowed inside a message."""
        return tuple(t for t in getattr(self.tokenizer, "all_special_tokens", ()) if t)

    def defused(self, messages: list[dict[str, str]]) -> list[dict[str, str]]:
        """``messages`` with every special token removed from all but system messages."""
        out = []
        for message in messages:
            content = message["content"]
            if message["role"] != "system":
                for token in self.special_tokens:
                    content = content.replace(token, "")
                if content != message["content"]:
                    log.warning("removed special tokens from a %s message (a forged turn?)", message["role"])
            out.append({**message, "content": content})
        return out

    def _count(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def grammars(self, schema: dict[str, Any] | None, knobs: SamplingKnobs, n: int = 1) -> list[Any]:
        """One grammar per row (None without a schema). The knobs act after the mask (a token the
        grammar forbids takes no part in top-k / top-p / min-p); the string caps are sized to
        close within the budget, and a budget below the smallest valid reply is refused here."""
        if schema is None:
            return [None] * n
        fitted = bounded(schema, knobs.max_new_tokens, self.chars_per_token, self._count)
        return [RowGrammar(self.tokenizer, fitted, self.n_vocab, knobs.max_new_tokens) for _ in range(n)]

    def prepare(
        self,
        messages: list[dict[str, str]],
        register: str | None,
        knobs: SamplingKnobs,
        schema: dict[str, Any] | None = None,
        seed: int | None = None,
        *,
        sink: Any = None,
        n: int = 1,
        stop: tuple[str, ...] = (),
        logprobs: int | None = None,
        prompt: list[int] | None = None,
        stream: bool = True,
    ) -> Job:
        """The engine's job for one request: the template applied, the grammar compiled (one per
        row), the seeds fixed (row i of a seeded request: ``seed + i``). The costly part of a
        request, done in the caller's thread, never on the decode thread."""
        adapter = self.adapter_for(register)
        ids = prompt if prompt is not None else self.prompt_ids(messages)
        seeds = [(seed + i) % 2**63 if seed is not None else random_seed() for i in range(n)]
        return Job(
            ids,
            adapter,
            knobs,
            seeds,
            self.grammars(schema, knobs, n),
            sink or (lambda event: None),
            tuple(stop),
            logprobs,
            register=adapter or "base",
            stream=stream,
        )


class LocalModel(VersionSpeaker):
    """One loaded version and the engine that decodes for it (started at once)."""

    def __init__(
        self,
        version: VerifiedVersion,
        device: str = "cpu",
        releases: Path | None = None,  # with keyring: adapters can be (re)loaded from the registry
        keyring: Keyring | None = None,
        settings: EngineSettings | None = None,
    ) -> None:
        self.releases, self.keyring = releases, keyring
        # both from one private copy whose bytes were hashed as read: what runs is what was verified
        self.model, tokenizer = load_verified(version, device=device)
        self.speak_with(version, tokenizer)
        self.registers = sorted(version.loras)
        self.n_vocab = int(self.model.config.vocab_size)
        self.context_tokens = int(self.model.config.max_position_embeddings)
        self.device = device
        self.settings = settings = settings or EngineSettings()
        self.dtype = serving_dtype(settings.dtype, device)
        self.model.to(self.dtype)  # published in float32: a no-op unless another dtype was asked for
        kv_dtype = None
        if device == "cpu":  # runtime/packed_linear.py, runtime/decode_attention.py
            pack_linears(self.model)
            if use_decode_attention(self.model):
                kv_dtype = torch.float32  # its attention runs in float32: no cast of the cache per step
        engine = {k: v for k, v in dataclasses.asdict(settings).items() if k != "dtype"}
        self.engine = Engine(self.model, self.tokenizer, self.stop_ids, kv_dtype=kv_dtype, **engine)

    @classmethod
    def open(
        cls,
        releases: Path,
        name: str,
        trusted_keys: Path,
        device: str = "cpu",
        settings: EngineSettings | None = None,
    ) -> LocalModel:
        keyring = Keyring.load(trusted_keys)
        return cls(open_version(releases, name, keyring), device, releases, keyring, settings)

    def generate(
        self,
        messages: list[dict[str, str]],
        register: str | None,
        knobs: SamplingKnobs,
        schema: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> Generation:
        """One reply through the engine, batched with whatever else is running (Ring A). A
        player's text cannot forge a turn: the tokenizer's special tokens are taken out of every
        message but the system prompt the runtime wrote (the server refuses them with a 400)."""
        messages = self.defused(messages)
        events: queue.Queue[Event] = queue.Queue()
        job = self.prepare(messages, register, knobs, schema, seed, sink=events.put, stream=False)
        self.engine.submit(job)
        while True:
            event = events.get()
            if isinstance(event, Failed):
                raise NimmerError(f"generation failed: {event.message}")
            if isinstance(event, Done):
                seconds = _now() - job.submitted
                return Generation(
                    event.text,
                    len(job.prompt),
                    event.completion_tokens,
                    seconds,
                    job.adapter,
                    event.finish_reason,
                )
            assert isinstance(event, Delta)

    # --- adapters at run time, only as the signed registry allows ----------------------------

    def load_register(self, register: str) -> None:
        """Load ``register``'s LoRA: the version is re-verified against the registry and its
        signed manifest, and only a LoRA they say fits it is loaded (never a path)."""
        if self.releases is None or self.keyring is None:
            raise NimmerError("this model was not opened from a releases folder; adapters are fixed")
        if register in self.registers:
            return
        version = open_version(self.releases, self.label, self.keyring)
        if register not in version.loras:
            raise CompatibilityError(
                f"the registry lists no signed LoRA for register {register!r} that fits {self.label}; "
                f"fitting: {', '.join(sorted(version.loras)) or 'none'}"
            )
        from nimmer_train.publish.versions import verified_copy

        one = dataclasses.replace(
            version,
            loras={register: version.loras[register]},
            lora_files={register: version.lora_files[register]},
        )
        with verified_copy(one) as copy:
            self.engine.call(lambda: self._attach(register, copy.loras[register])).result()
        self.version = version
        self.registers = sorted({*self.registers, register})

    def unload_register(self, register: str) -> None:
        """Unload ``register``'s LoRA (refused while a running or waiting request uses it)."""
        if register not in self.registers:
            raise CompatibilityError(f"no LoRA for register {register!r} is loaded on {self.label}")
        self.registers = [r for r in self.registers if r != register]  # no new requests for it
        try:
            self.engine.call(lambda: self._detach(register)).result()
        except Exception:
            self.registers = sorted({*self.registers, register})
            raise

    def _attach(self, register: str, folder: Path) -> None:  # on the decode thread
        from peft import PeftModel

        from nimmer_train.runtime.stacked_lora import StackedLora

        if isinstance(self.model, PeftModel):
            self.model.load_adapter(folder, adapter_name=register, is_trainable=False)
        else:
            self.model = PeftModel.from_pretrained(self.model, folder, adapter_name=register).eval()
            self.engine.model = self.model
        if self.engine.lora is None:
            self.engine.lora = StackedLora(self.model)
        else:
            self.engine.lora.rebuild()
        self.engine.prefixes.clear()

    def _detach(self, register: str) -> None:  # on the decode thread
        busy = [r for r in self.engine.rows if r.job.adapter == register]
        with self.engine.cond:  # accepted and waiting for the batch: they would fail at prefill;
            queued = [j for j in self.engine.waiting if j.adapter == register and not j.cancelled]
            if busy or queued:
                raise AdapterBusy(
                    f"register {register!r} is speaking in {len(busy)} rows and {len(queued)} "
                    "requests wait for it; unload it later"
                )
            assert self.engine.lora is not None  # from here submit refuses a job prepared for it
            self.engine.lora.names = [n for n in self.engine.lora.names if n != register]
        try:  # outside the lock: a request arriving now is not held up by the restacking
            self.model.delete_adapter(register)
        finally:
            self.engine.lora.rebuild()  # on this thread, before the next step
        self.engine.prefixes.clear()

    def close(self) -> None:
        """Finish what was accepted, then stop the engine."""
        self.engine.close(drain=True)


def _now() -> float:
    import time

    return time.perf_counter()
