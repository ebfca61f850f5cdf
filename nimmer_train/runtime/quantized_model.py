"""Ring A on the quantized engine (``runtime.engine=llama``): a verified version's GGUF base
(Q4_1 by default, or Q8_0) and its GGUF register LoRAs in one llama.cpp context
(:mod:`.llama_engine`), speaking one turn at a time.

llama.cpp computes the logits; the next token is chosen here exactly as the torch engine chooses
it (``runtime/engine.py``'s ``_choose``): the schema's grammar mask (:class:`RowGrammar`, the
project's llguidance mask, so every reply is schema-valid under the same grammar), then every
knob through :func:`warp_rows` (temperature, top-k, top-p, min-p, the repetition penalty on the
reply's own tokens only, the no-repeat n-gram and sentence guards), then :func:`sample_rows` with the turn's
seed. So no knob is approximated and none needs a compat warning; the draws differ from the
float32 engine's only as far as the quantized logits do.

The files are copied once into a private folder, hashed as they are copied (the bytes loaded are
the bytes verified, as for the torch path), and only the ones this engine needs: tokenizer,
config, the chosen GGUF base and the LoRA GGUFs, never the float32 safetensors."""

from __future__ import annotations

import collections
import shutil
import tempfile
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nimmer_train.config.schema import RuntimeConfig
from nimmer_train.errors import NimmerError
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import VerifiedVersion, _copy_verified, open_version
from nimmer_train.runtime.engine import Delta, Done, EngineClosed, Failed, Job, QueueFull
from nimmer_train.runtime.llama_engine import LlamaContext
from nimmer_train.runtime.local_model import Generation, VersionSpeaker
from nimmer_train.runtime.serve_metrics import ServeMetrics
from nimmer_train.voice.sampling import SamplingKnobs, sample_rows, warp_rows
from nimmer_train.voice.sentence_guard import tracker

QUANTS = ("q4_1", "q8_0")
WEIGHTS = "model.safetensors"


class NoQuantizedArtifacts(NimmerError):
    """A version published without the GGUF files the quantized engine runs."""


def quantized_section(version: VerifiedVersion, quant: str) -> dict[str, Any]:
    """The signed manifest's ``quantized`` entry, checked to name ``quant``'s base."""
    section = version.manifest.get("quantized")
    if not isinstance(section, dict) or not section.get("bases"):
        raise NoQuantizedArtifacts(
            f"{version.label} was published without quantized artifacts; publish it again, or use "
            "runtime.engine=torch"
        )
    if quant not in section["bases"]:
        raise NoQuantizedArtifacts(
            f"{version.label} ships {', '.join(section['bases'])}, not {quant}; set runtime.quant to one"
        )
    return section


class QuantizedModel(VersionSpeaker):
    """One verified version on llama.cpp: the same ``generate`` as :class:`LocalModel`."""

    def __init__(
        self,
        version: VerifiedVersion,
        quant: str = RuntimeConfig.quant,
        threads: int | None = None,
        n_ctx: int = 4096,
    ) -> None:
        from transformers import AutoTokenizer

        section = quantized_section(version, quant)
        self.quant = quant
        lora_paths = {r: p for r, p in section.get("loras", {}).items() if r in version.loras}
        wanted = {section["bases"][quant], *lora_paths.values()}
        files = [
            f
            for f in version.manifest["blob_distribution"]["files"]
            if f["path"] in wanted or not (f["path"].startswith("quantized/") or f["path"] == WEIGHTS)
        ]
        self._tmp = Path(tempfile.mkdtemp(prefix="nimmer-quantized-"))
        try:
            folder = _copy_verified(version.folder, files, self._tmp, version.label)
            self.speak_with(version, AutoTokenizer.from_pretrained(folder))
            self.context = LlamaContext(folder / section["bases"][quant], n_ctx=n_ctx, threads=threads)
            for register, rel in sorted(lora_paths.items()):
                self.context.load_adapter(register, folder / rel)
        except BaseException:
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self.registers = sorted(lora_paths)
        self.n_vocab = self.context.n_vocab
        self.context_tokens = n_ctx
        self.lock = threading.Lock()
        self.engine = SerialEngine(self)  # what nimmer serve --engine llama submits to

    @classmethod
    def open(
        cls,
        releases: Path,
        name: str,
        trusted_keys: Path,
        quant: str = RuntimeConfig.quant,
        threads: int | None = None,
    ) -> QuantizedModel:
        return cls(open_version(releases, name, Keyring.load(trusted_keys)), quant, threads)

    def generate(
        self,
        messages: list[dict[str, str]],
        register: str | None,
        knobs: SamplingKnobs,
        schema: dict[str, Any] | None = None,
        seed: int | None = None,
    ) -> Generation:
        """One reply (the special tokens taken out of the player's text, as the torch engine
        does); turns from several threads are spoken one after another."""
        adapter = self.adapter_for(register)
        prompt = self.prompt_ids(self.defused(messages))
        grammar = self.grammars(schema, knobs)[0]
        generator = torch.Generator().manual_seed(seed if seed is not None else int(time.time_ns()) % 2**63)
        with self.lock:
            started = time.perf_counter()
            ids, finish = self._decode(prompt, adapter, knobs, grammar, generator)
            seconds = time.perf_counter() - started
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        return Generation(text, len(prompt), len(ids), seconds, adapter, finish)

    def _decode(
        self,
        prompt: list[int],
        adapter: str | None,
        knobs: SamplingKnobs,
        grammar: Any,
        generator: Any,
        hook: Any = None,
    ) -> tuple[list[int], str]:
        """The reply's token ids and its finish reason (stop | length); ``hook(ids, logits)``
        after each token may end the reply (a stop string, a client gone) by returning True."""
        logits = self.context.prefill(prompt, adapter)
        ids: list[int] = []
        sentences = tracker(self.tokenizer, self.stop_ids, knobs.max_sentence_repeats, grammar is not None)
        while True:
            raw = torch.from_numpy(logits)
            scores = raw[None]
            if grammar is not None:
                scores = scores.masked_fill(~grammar.allowed(len(ids), scores.shape[-1])[None], float("-inf"))
            scores = warp_rows(scores, [knobs], [ids], [sentences.bans(ids) if sentences else set()])
            if bool(torch.isneginf(scores).all()):  # nothing allowed (a grammar in error): end
                return ids, "stop"
            token = sample_rows(scores, [generator])[0]
            ids.append(token)
            if grammar is not None:
                grammar.consume(token)
            if token in self.stop_ids or (hook is not None and hook(ids, raw)):
                return ids, "stop"
            if len(ids) >= knobs.max_new_tokens:
                return ids, "length"
            logits = self.context.step(token)

    def load_register(self, register: str) -> None:
        raise NimmerError("engine llama loads the version's LoRAs at start; restart nimmer serve to add one")

    unload_register = load_register

    def close(self) -> None:
        self.engine.close()
        with self.lock:
            self.context.close()
        shutil.rmtree(self._tmp, ignore_errors=True)


class SerialEngine:
    """What ``nimmer serve --engine llama`` decodes with: the jobs of :class:`QuantizedModel`
    one row at a time on one thread (llama.cpp's context holds one sequence), with the torch
    engine's events, queue limit and metrics, so the OpenAI server serves it unchanged."""

    def __init__(self, model: QuantizedModel, max_waiting: int = 64, stream_interval: int = 4) -> None:
        self.model, self.max_waiting, self.stream_interval = model, max_waiting, stream_interval
        self.max_batch = 16  # rows (n) one request may ask for; they decode one after another
        self.metrics = ServeMetrics()
        self.rows: list[Job] = []
        self.waiting: collections.deque[Job] = collections.deque()
        self.cond = threading.Condition()
        self.closing = False
        self.thread = threading.Thread(target=self._run, name="nimmer-llama", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive()

    def room(self) -> int:
        return self.max_waiting - sum(j.n for j in self.waiting) - len(self.rows)

    def retry_after_s(self) -> int:
        return max(1, len(self.waiting))

    def submit(self, job: Job) -> Job:
        with self.cond:
            if self.closing:
                raise EngineClosed("the engine is shutting down")
            if job.n > self.room():
                raise QueueFull(len(self.waiting), self.retry_after_s())
            self.waiting.append(job)
            self.cond.notify()
        return job

    def call(self, fn: Any) -> Future:
        future: Future = Future()
        future.set_result(fn())
        return future

    def close(self, drain: bool = True, timeout: float | None = None) -> None:
        with self.cond:
            self.closing = True
            if not drain:
                self.waiting.clear()
            self.cond.notify()
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            with self.cond:
                while not self.waiting and not self.closing:
                    self.cond.wait()
                if not self.waiting:
                    return
                job = self.waiting.popleft()
                self.rows = [job]
            try:
                if not job.cancelled:
                    for choice in range(job.n):
                        self._row(job, choice)
            except Exception as exc:  # one request failed: tell it, keep serving
                job.sink(Failed(str(exc)))
            finally:
                self.rows = []

    def _row(self, job: Job, choice: int) -> None:
        model, started = self.model, time.perf_counter()
        generator = torch.Generator().manual_seed(job.seeds[choice])
        state = {"sent": 0, "logprobs": [], "first": True}

        def hook(ids: list[int], raw: Any) -> bool:
            if state["first"]:
                model_started = time.perf_counter() - job.submitted
                self.metrics.started(job.register, len(job.prompt), model_started)
                state["first"] = False
            if job.logprobs is not None:
                state["logprobs"].append(_logprob(model.tokenizer, raw, ids[-1], job.logprobs))
            if not (job.stream or job.stop) or len(ids) % self.stream_interval:
                return job.cancelled
            text = model.tokenizer.decode(ids, skip_special_tokens=True)
            if any(s in text for s in job.stop):
                return True
            text = text.rstrip("\ufffd")  # a character still cut between tokens: sent once whole
            if job.stream and len(text) > state["sent"]:
                job.sink(Delta(choice, text[state["sent"] :]))
                state["sent"] = len(text)
            return job.cancelled

        with model.lock:
            ids, finish = model._decode(
                job.prompt, job.adapter, job.knobs, job.grammars[choice], generator, hook
            )
        text = model.tokenizer.decode(ids, skip_special_tokens=True)
        for s in job.stop:
            if (at := text.find(s)) >= 0:
                text, finish = text[:at], "stop"
        if job.stream and len(text) > state["sent"]:
            job.sink(Delta(choice, text[state["sent"] :]))
        lp = state["logprobs"] if job.logprobs is not None else None
        job.sink(Done(choice, finish, text, len(ids), lp))
        self.metrics.finished(job.register, len(ids), finish, time.perf_counter() - started)


def _logprob(tokenizer: Any, raw: Any, token: int, top: int) -> dict[str, Any]:
    """OpenAI's logprob entry from the model's own logits (before knobs and grammar)."""
    logp = torch.log_softmax(raw.float(), dim=-1)

    def entry(t: int) -> dict[str, Any]:
        text = tokenizer.decode([t])
        return {"token": text, "logprob": float(logp[t]), "bytes": list(text.encode("utf-8"))}

    out = entry(token)
    out["top_logprobs"] = [entry(int(t)) for t in logp.topk(top).indices] if top else []
    return out
