"""``nimmer serve --engine llama``: the OpenAI server over a version's GGUF on llama.cpp (one row
at a time), unchanged: the register's LoRA by model id, the schema enforced by the grammar, a
streamed reply and a whole one, the metrics; and the command line takes the engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from nimmer_train.cli import main
from nimmer_train.runtime.openai_server import create_app
from nimmer_train.runtime.quantized_model import QuantizedModel
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, validate_reply
from tests.helpers.loopback import serve_app

MESSAGES = [{"role": "user", "content": "What news from the gate tonight?"}]


@pytest.fixture(scope="module")
def quantized(published: tuple[Path, Path]) -> Iterator[QuantizedModel]:
    releases, trusted = published
    model = QuantizedModel.open(releases, "v1", trusted, "q8_0", threads=1)
    yield model
    model.close()


def test_serve_on_the_quantized_engine_speaks_schema_valid_streamed_and_whole(
    quantized: QuantizedModel,
) -> None:
    register = quantized.registers[0]
    with serve_app(create_app(quantized)) as url:
        assert f"{quantized.label}:{register}" in [
            m["id"] for m in httpx.get(f"{url}/v1/models").json()["data"]
        ]
        body = {
            "model": f"{quantized.label}:{register}",
            "messages": MESSAGES,
            "max_tokens": 48,
            "seed": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": TURN_SCHEMA}},
        }
        whole = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=600)
        assert whole.status_code == 200, whole.text
        text = whole.json()["choices"][0]["message"]["content"]
        assert validate_reply(text, TURN_SCHEMA)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        chunks = client.chat.completions.create(**{k: v for k, v in body.items()}, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == text  # the same seed, the same reply, streamed
        metrics = httpx.get(f"{url}/metrics").text
        assert f'nimmer_serve_completion_tokens_total{{register="{register}"}}' in metrics


def test_the_serve_command_line_takes_the_engine(published: tuple[Path, Path]) -> None:
    with pytest.raises(SystemExit):
        main(["serve", "--engine", "vllm"])
    import argparse

    from nimmer_train.cli.serve import register

    parser = argparse.ArgumentParser()
    register(parser)
    args = parser.parse_args(["--engine", "llama", "--quant", "q8_0"])
    assert (args.engine, args.quant) == ("llama", "q8_0")
