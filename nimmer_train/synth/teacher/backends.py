"""The four teacher backends: hf_local, openai_compatible, anthropic and replay."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx

from nimmer_train.config import TeacherConfig
from nimmer_train.errors import NimmerError
from nimmer_train.synth.teacher.base import Teacher, TeacherFatalError, TeacherReply
from nimmer_train.synth.teacher.http import post_with_retries
from nimmer_train.voice.composition import GenerationRequest
from nimmer_train.voice.sampling import NEUTRAL_WARPERS, knob_processors
from nimmer_train.voice.structured import end_of_turn_ids

EXTRA_KNOBS = ("top_k", "repetition_penalty", "min_p")
TURN_TOOL = "npc_turn"


def _api_key(cfg: TeacherConfig, required: bool) -> str | None:
    if not cfg.api_key_env:
        if required:
            raise TeacherFatalError(
                f"teacher.api_key_env must name the environment variable with the {cfg.backend} API key"
            )
        return None
    key = os.environ.get(cfg.api_key_env)
    if not key and required:
        raise TeacherFatalError(f"environment variable {cfg.api_key_env} (teacher.api_key_env) is not set")
    return key


def chat_completion_reply(data: dict[str, Any], dropped: tuple[str, ...] = ()) -> TeacherReply:
    """The text and token counts of an OpenAI Chat Completions response body."""
    usage = data.get("usage") or {}
    return TeacherReply(
        data["choices"][0]["message"]["content"],
        int(usage.get("prompt_tokens", 0)),
        int(usage.get("completion_tokens", 0)),
        dropped_knobs=dropped,
    )


class OpenAICompatible:
    """Chat Completions over HTTP: vLLM, llama.cpp server, Ollama, OpenRouter, Together, OpenAI."""

    backend = "openai_compatible"
    batch_size = 1

    def __init__(self, cfg: TeacherConfig) -> None:
        self.cfg, self.model, self.concurrency = cfg, cfg.model, cfg.concurrency
        key = _api_key(cfg, required=False)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.url = f"{str(cfg.base_url).rstrip('/')}/chat/completions"
        self.client = httpx.Client(limits=httpx.Limits(max_connections=cfg.concurrency))

    def generate(self, batch: list[GenerationRequest]) -> list[TeacherReply]:
        return [self._one(request) for request in batch]

    def _one(self, request: GenerationRequest) -> TeacherReply:
        knobs = request.sampling
        body: dict[str, Any] = {
            "model": self.model,
            "messages": request.messages,
            "temperature": knobs.temperature,
            "top_p": knobs.top_p,
            "max_tokens": self.cfg.max_new_tokens,
        }
        dropped: tuple[str, ...] = EXTRA_KNOBS
        if self.cfg.extra_sampling:
            body.update({k: getattr(knobs, k) for k in EXTRA_KNOBS})
            dropped = ()
        if self.cfg.json_mode:
            body["response_format"] = {"type": "json_object"}

        def parse(data: dict[str, Any]) -> TeacherReply:
            return chat_completion_reply(data, dropped)

        return post_with_retries(self.client, self.url, body, self.headers, self.cfg, parse)


class Anthropic:
    """The Anthropic Messages API (system prompt apart; temperature and top_k, no top_p)."""

    backend = "anthropic"
    batch_size = 1

    def __init__(self, cfg: TeacherConfig) -> None:
        self.cfg, self.model, self.concurrency = cfg, cfg.model, cfg.concurrency
        self.headers = {"x-api-key": _api_key(cfg, required=True) or "", "anthropic-version": "2023-06-01"}
        self.url = f"{(cfg.base_url or 'https://api.anthropic.com').rstrip('/')}/v1/messages"
        self.client = httpx.Client(limits=httpx.Limits(max_connections=cfg.concurrency))

    def generate(self, batch: list[GenerationRequest]) -> list[TeacherReply]:
        return [self._one(request) for request in batch]

    def _one(self, request: GenerationRequest) -> TeacherReply:
        system = "\n\n".join(m["content"] for m in request.messages if m["role"] == "system")
        turns = [m for m in request.messages if m["role"] != "system"]
        body = {
            "model": self.model,
            "system": system,
            "messages": turns,
            "max_tokens": self.cfg.max_new_tokens,
            "temperature": min(1.0, request.sampling.temperature),
            "top_k": request.sampling.top_k,
        }
        dropped = ("top_p", "repetition_penalty", "min_p")
        if self.cfg.json_tool:  # structured output through tool use: the input is the turn
            body["tools"] = [
                {
                    "name": TURN_TOOL,
                    "description": "Speak one turn.",
                    "input_schema": request.prompt.output_schema,
                }
            ]
            body["tool_choice"] = {"type": "tool", "name": TURN_TOOL}

        def parse(data: dict[str, Any]) -> TeacherReply:
            tool = [b["input"] for b in data["content"] if b["type"] == "tool_use" and b["name"] == TURN_TOOL]
            text = (
                json.dumps(tool[0])
                if tool
                else "".join(block["text"] for block in data["content"] if block["type"] == "text")
            )
            usage = data.get("usage") or {}
            return TeacherReply(
                text,
                int(usage.get("input_tokens", 0)),
                int(usage.get("output_tokens", 0)),
                dropped_knobs=dropped,
            )

        return post_with_retries(self.client, self.url, body, self.headers, self.cfg, parse)


class Replay:
    """Answers from a JSONL file keyed by request hash; unknown requests get an error reply."""

    backend = "replay"
    batch_size = 64
    concurrency = 1

    def __init__(self, cfg: TeacherConfig) -> None:
        path = Path(str(cfg.replay_file))
        if not path.is_file():
            raise NimmerError(f"replay file {path} (teacher.replay_file) does not exist")
        self.model = cfg.model
        self.answers: dict[str, dict[str, Any]] = {}
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                    self.answers[row["key"]] = row["response"]
                except (json.JSONDecodeError, KeyError) as exc:
                    raise NimmerError(
                        f"{path}:{n}: not a replay record with key and response ({exc})"
                    ) from exc

    def generate(self, batch: list[GenerationRequest]) -> list[TeacherReply]:
        out = []
        for request in batch:
            answer = self.answers.get(request.key)
            if answer is None:
                out.append(TeacherReply(None, error="no_replay_answer"))
            else:
                out.append(
                    TeacherReply(
                        answer.get("content"),
                        int(answer.get("prompt_tokens", 0)),
                        int(answer.get("completion_tokens", 0)),
                    )
                )
        return out


class BatchSchemaMask:
    """One :class:`~nimmer_train.voice.structured.RowGrammar` per row of a batched HF
    ``generate``: each row may only continue a reply valid under its turn's output_schema (in the
    training format, closing within the budget); a row that has ended its turn is left alone."""

    def __init__(self, grammars: list[Any], prompt_width: int, stop_ids: list[int]) -> None:
        self.grammars, self.width, self.stop = grammars, prompt_width, set(stop_ids)
        self.done = [False] * len(grammars)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        generated = input_ids.shape[1] - self.width
        for row, grammar in enumerate(self.grammars):
            if self.done[row]:
                continue
            if generated > 0:
                token = int(input_ids[row, -1])
                if token in self.stop:
                    self.done[row] = True
                    continue
                grammar.consume(token)
            allowed = grammar.allowed(generated, scores.shape[-1]).to(scores.device)
            scores[row] = scores[row].masked_fill(~allowed, float("-inf"))
        return scores


class HFLocal:
    """A local transformers causal LM: the composition's prompts through its chat template,
    batched generation (left-padded) with per-request sampling knobs (the repetition penalty on
    generated tokens only), stopping at the end-of-turn token. With ``json_mode`` each reply is
    constrained to its turn's output_schema, as the runtime does (a small instruct model rarely
    writes the JSON on its own)."""

    backend = "hf_local"
    concurrency = 1

    def __init__(self, cfg: TeacherConfig) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from nimmer_train.voice.structured import chars_per_token

        path = Path(str(cfg.model_path))
        if not (path / "config.json").exists():
            raise NimmerError(f"teacher.model_path {path} is not a transformers model folder")
        self.cfg, self.batch_size = cfg, cfg.batch_size
        self.model = cfg.model if cfg.model != "unknown" else path.name
        self.variant = f"|json_mode={cfg.json_mode}|max_new_tokens={cfg.max_new_tokens}"
        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if not self.tokenizer.chat_template:
            raise NimmerError(
                f"teacher.model_path {path}: its tokenizer has no chat template; use an instruct/chat model"
            )
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        device = "cuda" if torch.cuda.is_available() else "cpu"
        self.lm = AutoModelForCausalLM.from_pretrained(path).to(device).eval()
        self.stop_ids = end_of_turn_ids(self.tokenizer)
        self.n_vocab = self.lm.get_output_embeddings().weight.shape[0]
        self.density = chars_per_token(self.tokenizer)
        self.torch = torch

    def _mask(self, batch: list[GenerationRequest], width: int) -> list[Any]:
        """The schema mask for ``batch`` (first, so that the knobs act on allowed tokens only)."""
        if not self.cfg.json_mode:
            return []
        from nimmer_train.voice.structured import RowGrammar, bounded

        def count(text: str) -> int:
            return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

        budget = self.cfg.max_new_tokens
        grammars = [
            RowGrammar(
                self.tokenizer,
                bounded(r.prompt.output_schema, budget, self.density, count),
                self.n_vocab,
                budget,
            )
            for r in batch
        ]
        return [BatchSchemaMask(grammars, width, self.stop_ids)]

    def generate(self, batch: list[GenerationRequest]) -> list[TeacherReply]:
        from transformers import LogitsProcessorList

        replies: dict[int, TeacherReply] = {}
        by_knobs: dict[Any, list[int]] = {}
        for i, request in enumerate(batch):
            by_knobs.setdefault(request.sampling, []).append(i)
        for knobs, indices in by_knobs.items():
            texts = [
                self.tokenizer.apply_chat_template(
                    batch[i].messages, tokenize=False, add_generation_prompt=True
                )
                for i in indices
            ]
            enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            enc = enc.to(self.lm.device)
            width = enc["input_ids"].shape[1]  # every prompt, left-padded to the same width
            processors = [*self._mask([batch[i] for i in indices], width), *knob_processors(knobs, width)]
            self.torch.manual_seed(int(batch[indices[0]].key[:8], 16))
            started = time.perf_counter()
            with self.torch.no_grad():
                out = self.lm.generate(
                    **enc,
                    **NEUTRAL_WARPERS,
                    logits_processor=LogitsProcessorList(processors),
                    max_new_tokens=self.cfg.max_new_tokens,
                    pad_token_id=self.tokenizer.pad_token_id,
                    eos_token_id=self.stop_ids,
                )
            seconds = time.perf_counter() - started  # each row's latency: its whole generate call
            for row, i in enumerate(indices):
                new = out[row, width:]
                prompt_len = int(enc["attention_mask"][row].sum())
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                done = int((new != self.tokenizer.pad_token_id).sum())
                replies[i] = TeacherReply(text, prompt_len, done, seconds)
        return [replies[i] for i in range(len(batch))]


def make_teacher(cfg: TeacherConfig) -> Teacher:
    backends = {
        "openai_compatible": OpenAICompatible,
        "anthropic": Anthropic,
        "replay": Replay,
        "hf_local": HFLocal,
    }
    return backends[cfg.backend](cfg)
