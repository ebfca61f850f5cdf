"""The teacher group: which backend writes synthetic dialogue, and how it is called."""

from __future__ import annotations

from dataclasses import dataclass

from nimmer_train.errors import ConfigError

BACKENDS = ("hf_local", "openai_compatible", "anthropic", "replay")


@dataclass
class TeacherConfig:
    backend: str = "replay"
    model: str = "unknown"  # the model name sent to the API / recorded for provenance
    base_url: str | None = None  # openai_compatible: .../v1 ; anthropic: https://api.anthropic.com
    api_key_env: str | None = None  # name of the environment variable that holds the key
    model_path: str | None = None  # hf_local: a local transformers causal-LM folder
    replay_file: str | None = None  # replay: JSONL of {key, response: {content, ...}}
    provenance: str = ""  # free text for the data card, e.g. "hand-written seed set"
    concurrency: int = 8
    timeout_s: float = 60.0
    max_retries: int = 5
    # share of requests that may fail at the transport level (no reply after retries) before the
    # run stops with an error instead of publishing a thin corpus; the cache keeps what arrived
    max_failure_share: float = 0.02
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    batch_size: int = 8  # hf_local generation batch
    max_new_tokens: int = 200
    json_mode: bool = True  # ask for JSON where the API can (OpenAI response_format)
    json_tool: bool = False  # anthropic: force a tool call whose input_schema is the output_schema
    extra_sampling: bool = True  # send top_k / repetition_penalty / min_p (vLLM, llama.cpp, ...)
    price_in_per_mtok: float = 0.0  # USD per million prompt tokens, for the cost figure
    price_out_per_mtok: float = 0.0
    cache: str = "${paths.workdir}/cache/teacher_cache.sqlite"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ConfigError(
                "teacher.backend", f"unknown backend {self.backend!r}; known: {', '.join(BACKENDS)}"
            )
        needs = {"hf_local": "model_path", "openai_compatible": "base_url", "replay": "replay_file"}
        if self.backend in needs and not getattr(self, needs[self.backend]):
            raise ConfigError(
                f"teacher.{needs[self.backend]}", f"required for teacher.backend={self.backend}"
            )
        if not 0.0 <= self.max_failure_share < 1.0:
            raise ConfigError("teacher.max_failure_share", f"must be in [0, 1), got {self.max_failure_share}")
        if self.concurrency < 1:
            raise ConfigError("teacher.concurrency", "must be >= 1")
