"""Issue 22, items 1 and 2: the runtime grammar accepts exactly the training format, and its length
caps admit the training replies at the configured max_new_tokens.

Each training target of ci_tiny's r1 is decoded token by token, with the real tiny tokenizer,
under the SchemaMask the runtime builds; the bounded schema is checked against every training reply
on ci_tiny's tokenizer and on the demo's (trained here as build_base trains it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from datasets import load_from_disk
from jsonschema import validate
from transformers import AutoTokenizer

from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.corpus.ingest import ingest
from nimmer_train.loras.train import encode
from nimmer_train.voice.prompt_dsl import TURN_SCHEMA, render_reply, validate_reply
from nimmer_train.voice.structured import SchemaMask, bounded, chars_per_token, end_of_turn_ids
from tests.helpers.compose import config
from tests.helpers.outputs import base_dir, synth_dir

pytestmark = pytest.mark.slow


def _training_rows(workdir: Path) -> list[dict]:
    return load_from_disk(str(synth_dir(workdir) / "r1"))["train"].to_list()


def _count(tokenizer):  # noqa: ANN001, ANN202
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_one_render_function_round_trips_the_training_targets(tiny_run: Path) -> None:
    for row in _training_rows(tiny_run):
        target = row["messages"][-1]["content"]
        reply = validate_reply(target, TURN_SCHEMA)
        assert render_reply(reply) == target  # training targets are render_reply's output
        assert render_reply(reply) == json.dumps(reply, ensure_ascii=False)  # ", " and ": ", schema order


def test_training_targets_decode_under_the_runtime_grammar(tiny_run: Path) -> None:
    """Every assistant token the adapters were trained on (the reply and the end-of-turn token) is
    allowed by the mask the runtime puts first, at the runtime's configured max_new_tokens."""
    tokenizer = AutoTokenizer.from_pretrained(base_dir(tiny_run))
    n_vocab = len(tokenizer)
    budget = config("experiment=ci_tiny").runtime.max_new_tokens
    schema = bounded(TURN_SCHEMA, budget, chars_per_token(tokenizer), _count(tokenizer))
    rows = _training_rows(tiny_run)
    assert len(rows) > 100
    for row in rows[::5]:
        enc = encode(tokenizer, row["messages"], 10_000)
        target = [t for t, label in zip(enc["input_ids"], enc["labels"], strict=True) if label != -100]
        assert target[-1] in end_of_turn_ids(tokenizer)
        mask = SchemaMask(tokenizer, schema, n_vocab, 0)
        ids = torch.zeros((1, 0), dtype=torch.long)
        for step, token in enumerate(target):
            scores = mask(ids, torch.zeros((1, n_vocab)))
            piece = tokenizer.convert_ids_to_tokens([token])
            assert scores[0, token] > float("-inf"), f"token {step} {piece} of a training target is masked"
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def _demo_tokenizer(tmp_path: Path):  # noqa: ANN202
    """The tiny preset base's tokenizer, trained as build_base trains it (on the ingested corpus)."""
    cfg = config("experiment=tiny", f"paths.workdir={tmp_path}")
    dataset = load_from_disk(str(ingest(cfg.corpus, tmp_path / "artifacts").dataset_dir))
    return train_bpe(dataset["train"]["text"], cfg.model.vocab_size, cfg.model.max_position_embeddings)


@pytest.mark.parametrize("preset", ["ci_tiny", "tiny"])
def test_training_replies_fit_the_bounded_schema(preset: str, tiny_run: Path, tmp_path: Path) -> None:
    """At the preset's runtime.max_new_tokens, every training reply (ci_tiny and tiny train on the
    same r1) is admitted by the caps Ring A decodes under and fits the token budget."""
    if preset == "ci_tiny":
        tokenizer = AutoTokenizer.from_pretrained(base_dir(tiny_run))
    else:
        tokenizer = _demo_tokenizer(tmp_path)
    budget = config(f"experiment={preset}").runtime.max_new_tokens
    schema = bounded(TURN_SCHEMA, budget, chars_per_token(tokenizer), _count(tokenizer))
    assert set(schema["properties"]) == set(TURN_SCHEMA["properties"])
    count = _count(tokenizer)
    for row in _training_rows(tiny_run):
        target = row["messages"][-1]["content"]
        validate(json.loads(target), schema)
        assert count(target) + 1 <= budget  # the reply and its end-of-turn token
