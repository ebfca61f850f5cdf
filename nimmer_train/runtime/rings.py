"""The three rings of inference behind one call, chosen per tier (the design's player_llm_config):

- Ring A: in-process, the register's LoRA, schema-constrained decoding; on the float32 torch
  engine (:class:`LocalModel`, the reference) or on llama.cpp over the release's GGUF files
  (:class:`~nimmer_train.runtime.quantized_model.QuantizedModel`, ``engine="llama"``).
- Ring B: our OpenAI-compatible server (``nimmer serve``, or a vLLM multi-LoRA farm): the model id
  ``<version>:<register>`` picks the adapter; every knob is sent; the schema goes as
  ``response_format`` and is enforced server-side.
- Ring C: an external provider with the player's own key (OpenAI-compatible or Anthropic, through
  the teacher backends: retries with backoff, classified errors, token counts). There is no LoRA,
  so the register is emulated by the trait-projection prompt; knobs the provider lacks are dropped
  and recorded as feature_compat_warnings; JSON mode (OpenAI) or a forced tool call (Anthropic).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx

from nimmer_train.config import TeacherConfig
from nimmer_train.config.providers import (
    HIVEMIND_KEY_ENV,
    HIVEMIND_PROVIDER,
    PROFILES,
    adapt,
    check_tier_ring,
)
from nimmer_train.config.providers import config_warnings as provider_warnings
from nimmer_train.config.schema import RuntimeConfig
from nimmer_train.errors import ConfigError, NimmerError
from nimmer_train.synth.teacher.backends import chat_completion_reply, make_teacher
from nimmer_train.synth.teacher.base import TeacherFatalError
from nimmer_train.synth.teacher.http import deadline, post_with_retries
from nimmer_train.voice.composition import GenerationRequest
from nimmer_train.voice.prompt_dsl import TurnPrompt, render_compact, render_projection
from nimmer_train.voice.registers import Register
from nimmer_train.voice.sampling import SamplingKnobs

RINGS = ("A", "B", "C")
ENGINES = ("torch", "llama")  # Ring A: the float32 reference, or llama.cpp on the GGUF files
log = logging.getLogger(__name__)
PROVIDERS = tuple(PROFILES)  # one row per provider: config/providers.py


@dataclass
class RingConfig:
    """How one tier (casual or deep) is served."""

    ring: str = "A"
    base_url: str | None = None  # B: http://host:port/v1 of nimmer serve; C: the provider's API
    provider: str = "openai_compatible"  # C: openai_compatible | anthropic
    model: str | None = None  # C: the provider's model name
    api_key_env: str | None = None  # C: environment variable with the player's own key
    price_in_per_mtok: float = 0.0  # C: USD per million tokens, for the cost figure
    price_out_per_mtok: float = 0.0
    timeout_s: float = 60.0
    max_retries: int = 3
    # B and C: the longest one turn waits on the ring, retries, backoff and a server's Retry-After
    # included; a wait past it is not taken (the turn gets an error reply, not a sleep of days)
    deadline_s: float = 120.0
    constrained: bool = True  # A and B: schema-constrained decoding
    context_tokens: int | None = None  # B and C: the model's context window; null: not limited
    api_key: str | None = field(default=None, repr=False)  # B and C: the key itself (a sealed BYOK key)

    def __post_init__(self) -> None:
        if self.ring not in RINGS:
            raise ConfigError("ring", f"unknown ring {self.ring!r}; known: {', '.join(RINGS)}")
        if self.ring in ("B", "C") and not self.base_url and self.backend != "anthropic":
            raise ConfigError("base_url", f"required for ring {self.ring}")
        if self.ring == "C" and (self.provider not in PROFILES or not self.model):
            raise ConfigError("provider/model", f"ring C needs provider in {PROVIDERS} and a model")
        if not 0 < self.deadline_s < float("inf"):
            raise ConfigError("deadline_s", f"{self.deadline_s!r}; seconds a turn may wait, over 0")

    @property
    def backend(self) -> str:
        """The wire format: the provider profile's (Ring C), Chat Completions otherwise."""
        return PROFILES[self.provider].backend if self.provider in PROFILES else "openai_compatible"

    def teacher(self, max_new_tokens: int) -> TeacherConfig:
        extra = self.ring == "C" and {"top_k", "min_p"} <= set(PROFILES[self.provider].knobs)
        return TeacherConfig(
            backend="openai_compatible" if self.ring == "B" else self.backend,
            model=self.model or "nimmer",
            base_url=self.base_url,
            api_key_env=self.api_key_env,
            timeout_s=self.timeout_s,
            max_retries=self.max_retries,
            max_new_tokens=max_new_tokens,
            json_mode=True,
            json_tool=True,
            extra_sampling=extra,  # the provider's profile takes every knob
            price_in_per_mtok=self.price_in_per_mtok,
            price_out_per_mtok=self.price_out_per_mtok,
        )


@dataclass
class RingReply:
    text: str | None
    ring: str
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0
    cost_usd: float = 0.0
    adapter: str | None = None  # the LoRA that spoke (A, B); None for C or the bare version
    constrained: bool = False  # the schema was enforced while decoding
    feature_compat_warnings: list[str] = field(default_factory=list)
    error: str | None = None  # timeout, connection, http_503, malformed_response, ...


def word_count(text: str) -> int:
    """A tokenizer-free estimate (about 1.3 tokens per word) where the ring's tokenizer is unknown."""
    return int(len(text.split()) * 1.3) + 1


class Ring(Protocol):
    name: str
    constrained: bool
    context_tokens: int | None  # prompt + reply must fit in this many tokens
    local: bool  # the prompt stays in this process (Ring A); only then may it carry clasp memory

    def count(self, text: str) -> int: ...

    def render(self, prompt: TurnPrompt, register: Register) -> list[dict[str, str]]: ...

    def speak(self, prompt: TurnPrompt, register: Register, name: str, knobs: SamplingKnobs) -> RingReply: ...


def refuse_clasp(prompt: TurnPrompt, ring: str) -> None:
    """The last guard before a prompt leaves the device: it never carries the clasp layer."""
    if "clasp" in prompt.memory_scope.layers:
        raise NimmerError(
            f"ring {ring} is remote: clasp memory has no transport path; assemble the turn with "
            "local=False (the runtime does) so the clasp layer is left out"
        )


class RingA:
    name = "A"
    local = True  # in-process: the only ring that may be given clasp memory

    def __init__(self, model: Any, constrained: bool = True, warnings: list[str] | None = None) -> None:
        self.model, self.constrained = model, constrained
        self.context_tokens: int | None = model.context_tokens
        self.warnings = list(warnings or [])  # carried by every reply (an engine fallback)

    @classmethod
    def open(
        cls,
        releases: Any,
        name: str,
        trusted_keys: Any,
        constrained: bool = True,
        engine: str = "torch",
        quant: str = RuntimeConfig.quant,
        fallback: bool = False,
        threads: int | None = None,
    ) -> RingA:
        """A session's Ring A: ``name`` (e.g. ``production``) resolved in the registry now, the
        version verified and loaded on ``engine`` (``torch``: the float32 reference;
        ``llama``: its ``quant`` GGUF on llama.cpp). A session keeps its version; a version
        pulled or promoted meanwhile speaks from the next session on (close the model with
        ``ring.model.close()``). With ``fallback``, an engine that cannot run here, or a version
        without quantized artifacts, falls back to the float32 path and every reply says so; a
        file that fails verification never falls back."""
        from nimmer_train.runtime.local_model import LocalModel

        if engine not in ENGINES:
            raise ConfigError("runtime.engine", f"{engine!r}; known: {', '.join(ENGINES)}")
        if engine == "torch":
            return cls(LocalModel.open(releases, name, trusted_keys), constrained)
        from nimmer_train.publish.llama_binding import EngineUnavailable
        from nimmer_train.runtime.quantized_model import NoQuantizedArtifacts, QuantizedModel

        try:
            return cls(QuantizedModel.open(releases, name, trusted_keys, quant, threads), constrained)
        except (EngineUnavailable, NoQuantizedArtifacts) as exc:
            if not fallback:
                raise
            reason = str(exc).splitlines()[0]
            warning = f"quantized_engine_fell_back_to_float32: {reason}"
            log.warning("Ring A: %s", warning)
            return cls(LocalModel.open(releases, name, trusted_keys), constrained, [warning])

    def count(self, text: str) -> int:
        return len(self.model.tokenizer(text, add_special_tokens=False, verbose=False).input_ids)

    def render(self, prompt: TurnPrompt, register: Register) -> list[dict[str, str]]:
        return render_compact(prompt)

    def speak(self, prompt: TurnPrompt, register: Register, name: str, knobs: SamplingKnobs) -> RingReply:
        schema = prompt.output_schema if self.constrained else None
        out = self.model.generate(self.render(prompt, register), name, knobs, schema)
        return RingReply(
            out.text,
            "A",
            out.prompt_tokens,
            out.completion_tokens,
            out.seconds,
            0.0,
            out.adapter,
            self.constrained,
            list(self.warnings),
        )


class RingB:
    """A client of an OpenAI-compatible multi-LoRA server (nimmer serve, vLLM)."""

    name = "B"
    local = False

    def __init__(self, cfg: RingConfig, client: httpx.Client | None = None) -> None:
        self.cfg, self.constrained, self.context_tokens = cfg, cfg.constrained, cfg.context_tokens
        self.count = word_count
        self.base = str(cfg.base_url).rstrip("/")
        self.client = client or httpx.Client()
        self._models: list[str] | None = None

    def model_id(self, register: str) -> str:
        if self._models is None:
            reply = self.client.get(
                f"{self.base}/models", headers=self._headers(), timeout=self.cfg.timeout_s
            )
            reply.raise_for_status()
            self._models = [m["id"] for m in reply.json()["data"]]
        base = next(m for m in self._models if ":" not in m)
        wanted = f"{base}:{register}"
        return wanted if wanted in self._models else base  # the register merged into the base

    def render(self, prompt: TurnPrompt, register: Register) -> list[dict[str, str]]:
        return render_compact(prompt)

    def _headers(self) -> dict[str, str]:
        """``Authorization: Bearer`` from ``api_key_env`` (``nimmer serve --api-key-env``), if set."""
        key = self.cfg.api_key or (os.environ.get(self.cfg.api_key_env) if self.cfg.api_key_env else None)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def speak(self, prompt: TurnPrompt, register: Register, name: str, knobs: SamplingKnobs) -> RingReply:
        refuse_clasp(prompt, self.name)
        model = self.model_id(name)
        body: dict[str, Any] = {
            "model": model,
            "messages": self.render(prompt, register),
            "max_tokens": knobs.max_new_tokens,
            **{k: v for k, v in knobs.as_dict().items() if k != "max_new_tokens"},
        }
        if self.constrained:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "npc_turn", "schema": prompt.output_schema},
            }

        started = time.perf_counter()
        url, teacher = f"{self.base}/chat/completions", self.cfg.teacher(knobs.max_new_tokens)
        with deadline(self.cfg.deadline_s):
            try:
                reply = post_with_retries(
                    self.client, url, body, self._headers(), teacher, chat_completion_reply
                )
            except TeacherFatalError as exc:  # a 404: nimmer serve moved to the version its alias names
                if " answered 404" not in str(exc):
                    raise
                self._models = None  # ask the server what it serves now, once
                model = body["model"] = self.model_id(name)
                reply = post_with_retries(
                    self.client, url, body, self._headers(), teacher, chat_completion_reply
                )
        return RingReply(
            reply.content,
            "B",
            reply.prompt_tokens,
            reply.completion_tokens,
            time.perf_counter() - started,
            adapter=model.split(":", 1)[1] if ":" in model else None,
            constrained=self.constrained,
            error=reply.error,
        )


class RingC:
    """An external provider with the player's key; the register emulated by the projection prompt."""

    name = "C"
    constrained = False
    local = False

    def __init__(self, cfg: RingConfig, tools: Any = None) -> None:
        self.cfg, self.context_tokens, self.count = cfg, cfg.context_tokens, word_count
        self._make = make_teacher  # one teacher backend per turn: its knobs set max_new_tokens
        self.tools = tools  # a memory ToolRegistry offered to the provider (runtime/tool_calls.py)
        self.tool_calls: list[Any] = []  # the last turn's executed tool calls

    def render(self, prompt: TurnPrompt, register: Register) -> list[dict[str, str]]:
        return render_projection(prompt, register)

    def speak(self, prompt: TurnPrompt, register: Register, name: str, knobs: SamplingKnobs) -> RingReply:
        refuse_clasp(prompt, self.name)
        knobs, warnings = adapt(knobs, self.cfg.provider)  # drop, clamp, emulate (the profile)
        teacher_cfg = self.cfg.teacher(knobs.max_new_tokens)
        teacher = (
            self._make(teacher_cfg)
            if self.cfg.api_key is None
            else keyed_teacher(teacher_cfg, self.cfg.api_key)
        )
        messages = self.render(prompt, register)
        request = GenerationRequest(name, {}, prompt, messages, knobs, key="")
        # --- issue 16: memory tools in the turn loop (OpenAI-compatible providers) ---
        with deadline(self.cfg.deadline_s):  # every round of a tool loop included
            if self.tools is not None and self.cfg.backend == "openai_compatible":
                from nimmer_train.runtime.tool_calls import chat_with_tools

                turn = chat_with_tools(teacher, request, self.tools)
                reply, self.tool_calls = turn.reply, turn.calls
            else:
                reply = teacher.generate([request])[0]
        # --- end issue 16 ---
        cost = (
            reply.prompt_tokens * self.cfg.price_in_per_mtok
            + reply.completion_tokens * self.cfg.price_out_per_mtok
        ) / 1e6
        return RingReply(
            reply.content,
            "C",
            reply.prompt_tokens,
            reply.completion_tokens,
            reply.latency_s,
            cost,
            feature_compat_warnings=warnings,
            error=reply.error,
        )


RING_CODES = {"A_local": "A", "B_our_farm": "B", "C_external": "C"}


def compat_warnings(cfg: RingConfig) -> list[str]:
    """What a tier loses in its ring, known at config time (the design's feature_compat_warnings)."""
    return provider_warnings(cfg.provider) if cfg.ring == "C" else []


def keyed_teacher(cfg: TeacherConfig, key: str) -> Any:
    """A provider backend that sends ``key`` itself (a BYOK key unsealed by the runtime), never
    through an environment variable."""
    from nimmer_train.synth.teacher.backends import Anthropic, OpenAICompatible

    if cfg.backend == "anthropic":
        teacher = Anthropic.__new__(Anthropic)
        teacher.cfg, teacher.model, teacher.concurrency = cfg, cfg.model, cfg.concurrency
        teacher.headers = {"x-api-key": key, "anthropic-version": "2023-06-01"}
        teacher.url = f"{(cfg.base_url or 'https://api.anthropic.com').rstrip('/')}/v1/messages"
        teacher.client = httpx.Client(limits=httpx.Limits(max_connections=cfg.concurrency))
        return teacher
    teacher = OpenAICompatible(dataclasses.replace(cfg, api_key_env=None))
    teacher.headers = {"Authorization": f"Bearer {key}"}
    return teacher


def player_rings(
    row: dict[str, Any], local: Any = None, keys: dict[str, str] | None = None
) -> tuple[dict[str, Ring], dict[str, list[str]]]:
    """Rings per tier from a player_llm_config row (``casual_tier_ring``: A_local, B_our_farm or
    C_external; ``*_provider``, ``*_endpoint``, ``*_credentials_ref`` = the environment variable
    holding the player's key, ``*_model``), and the feature_compat_warnings per tier. Ring A needs
    ``local`` (a LocalModel). The deep (Theia) tier on A_local is refused; the hivemind tier is
    always Anthropic through us (our key in ``NIMMER_HIVEMIND_API_KEY``, never the player's)."""
    rings: dict[str, Ring] = {}
    warnings: dict[str, list[str]] = {}
    for tier in ("casual", "deep"):
        code = row.get(f"{tier}_tier_ring")
        if code is None:
            continue
        if code not in RING_CODES:
            raise ConfigError(f"{tier}_tier_ring", f"{code!r}; known: {', '.join(RING_CODES)}")
        cfg = RingConfig(
            ring=RING_CODES[code],
            base_url=row.get(f"{tier}_tier_endpoint"),
            provider=row.get(f"{tier}_tier_provider") or "openai_compatible",
            model=row.get(f"{tier}_tier_model"),
            api_key_env=None if tier in (keys or {}) else row.get(f"{tier}_tier_credentials_ref"),
            api_key=(keys or {}).get(tier),  # sealed BYOK keys (memory/llm_config.py)
        )
        check_tier_ring(tier, cfg.ring)  # Tier x Ring matrix: Theia never on Ring A
        if cfg.ring == "A" and local is None:
            raise ConfigError(f"{tier}_tier_ring", "A_local needs the local model loaded on this device")
        rings[tier] = RingA(local) if cfg.ring == "A" else RingB(cfg) if cfg.ring == "B" else RingC(cfg)
        warnings[f"{tier}_tier"] = compat_warnings(cfg)
    hivemind = row.get("hivemind_tier_provider") or HIVEMIND_PROVIDER
    if hivemind != HIVEMIND_PROVIDER:
        raise ConfigError(
            "hivemind_tier_provider", f"{hivemind!r}; the hivemind is fixed: {HIVEMIND_PROVIDER}"
        )
    if row.get("hivemind_tier_model"):  # the hivemind speaks only where we configured it
        rings["hivemind"] = RingC(
            RingConfig(
                ring="C",
                provider="anthropic",
                base_url=row.get("hivemind_tier_endpoint"),
                model=row["hivemind_tier_model"],
                api_key_env=HIVEMIND_KEY_ENV,
            )
        )
    return rings, warnings
