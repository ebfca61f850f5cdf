"""``nimmer serve``: an OpenAI-compatible server over a verified version (Ring B), on loopback
or behind a bearer token."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import Any

import uvicorn

from nimmer_train.cli.common import trusted_keys
from nimmer_train.config.schema import RuntimeConfig
from nimmer_train.errors import NimmerError
from nimmer_train.runtime.local_model import EngineSettings, LocalModel
from nimmer_train.runtime.openai_server import Reload, create_app, model_ids

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def register(serve: argparse.ArgumentParser) -> None:
    serve.add_argument("--releases", type=Path, default=Path("releases"))
    serve.add_argument("--trusted-keys", type=Path, default=None, help="default: RELEASES/../keys/trusted")
    serve.add_argument(
        "--version", default="production", help="vN, a label or an alias (default: production)"
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--api-key-env",
        default=None,
        help="environment variable holding a bearer token every request must send; "
        "required to bind beyond loopback",
    )
    serve.add_argument(
        "--allow-adapter-updates",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter (registry-listed LoRAs only)",
    )
    serve.add_argument(
        "--reload-s",
        type=float,
        default=5.0,
        help="resolve --version again every this many seconds and swap in the version it names "
        "now, finishing turns in flight on the old one (0: never; default 5)",
    )
    serve.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "auto"),
        default="float32",
        help="the weights' dtype while serving (auto: bfloat16 where the CPU has AMX or AVX512-BF16, "
        "or on a CUDA GPU with bfloat16; a seeded request may then differ alone and in a batch)",
    )
    serve.add_argument(
        "--engine",
        choices=("torch", "llama"),
        default="torch",
        help="torch: the float32 engine that batches rows with different LoRAs (farms, GPUs, "
        "concurrency); llama: the version's GGUF on llama.cpp, one row at a time (one register "
        "per process, or low concurrency on a CPU; docs/runtime.md)",
    )
    serve.add_argument(
        "--quant", choices=("q4_1", "q8_0"), default=RuntimeConfig.quant, help="--engine llama: the GGUF base"
    )
    serve.add_argument(
        "--stream-interval",
        type=_positive_int,
        default=4,
        help="a streamed choice's text is sent every this many tokens, its first text at once "
        "(1: every token, at a cost to every running turn; default 4)",
    )


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: must be 1 or more")
    return value


def serve_api_key(host: str, api_key_env: str | None) -> str | None:
    """The bearer token ``nimmer serve`` requires (from the environment variable named), or
    None on loopback without one; binding beyond loopback without a token is refused."""
    if api_key_env:
        key = os.environ.get(api_key_env, "")
        if len(key) < 16:
            raise NimmerError(
                f"--api-key-env {api_key_env}: the variable is unset or shorter than 16 characters; "
                "set it to a long random token (`python -c 'import secrets; print(secrets.token_hex())'`)"
            )
        return key
    if host not in LOOPBACK:
        raise NimmerError(
            f"--host {host} binds beyond loopback: anyone who reaches it could use the model; "
            "pass --api-key-env VAR (clients send Authorization: Bearer $VAR) or bind 127.0.0.1"
        )
    return None


def run(args: argparse.Namespace) -> int:
    api_key = serve_api_key(args.host, args.api_key_env)
    settings = EngineSettings(dtype=args.dtype, stream_interval=args.stream_interval)
    trusted = trusted_keys(args)
    auth = " (bearer token required)" if api_key else ""

    def open_model(name: str) -> Any:
        if args.engine == "llama":
            from nimmer_train.runtime.quantized_model import QuantizedModel

            return QuantizedModel.open(args.releases, name, trusted, args.quant)
        return LocalModel.open(args.releases, name, trusted, settings=settings)

    def load() -> Any:  # in a thread once the port is open: /health says 503 meanwhile
        model = open_model(args.version)
        print(f"serving {', '.join(model_ids(model))} on http://{args.host}:{args.port}/v1{auth}", flush=True)
        return model

    # follow the alias: a version promoted (or pulled) while serving is swapped in, turns kept
    reload = (
        dataclasses.replace(
            Reload.alias(args.releases, args.version, trusted, args.reload_s, settings), load=open_model
        )
        if args.reload_s > 0
        else None
    )
    app = create_app(load, api_key=api_key, adapter_updates=args.allow_adapter_updates, reload=reload)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0
