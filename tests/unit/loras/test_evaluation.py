"""The register evaluation (issue 22, items 3, 4 and 7): losses by token class, so that
separability and gain measure the voice (utterance tokens) and not the JSON format; bootstrap
intervals and n per cell; the unfiltered r0 set; MLflow, evaluation.json and the model card; and
sample generations that stop at the end-of-turn token."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from transformers import AutoTokenizer

from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.loras.adapters import load_all
from nimmer_train.loras.evaluation import BASE, TOKEN_CLASSES, _sample, score, token_classes
from nimmer_train.loras.stage import EVALUATION
from nimmer_train.voice.prompt_dsl import render_reply
from tests.helpers.compose import config
from tests.helpers.outputs import adapters as _adapters
from tests.helpers.outputs import base_dir

TWO = ("hivemind-broadcast", "drunk-scavenger")
REPLY = {"utterance": "Citizen. Return to your corridor.", "emotion": "cold", "gesture": "lamps turn"}


def test_tokens_are_classed_as_utterance_fields_and_format() -> None:
    tok = train_bpe(["Citizen. Return to your corridor. The lamps turn cold. " * 40] * 5, 400, 256)
    conversation = [
        {"role": "system", "content": '{"role":"the hivemind"}'},
        {"role": "user", "content": "Where is the water?"},
        {"role": "assistant", "content": render_reply(REPLY)},
    ]
    enc = token_classes(tok, conversation, 256)
    by_class = {
        name: tok.decode([t for t, c in zip(enc["input_ids"], enc["classes"], strict=True) if c == i])
        for i, name in enumerate(TOKEN_CLASSES)
    }
    assert REPLY["utterance"] in by_class["utterance"]  # the whole utterance...
    assert "utterance" not in by_class["utterance"] and "<|im_end|>" not in by_class["utterance"]
    assert "cold" in by_class["fields"] and "lamps turn" in by_class["fields"]
    assert '"emotion"' in by_class["format"] and by_class["format"].endswith("}<|im_end|>")
    prompt = [c for c, label in zip(enc["classes"], enc["labels"], strict=True) if label == -100]
    assert set(prompt) == {-1}  # only the reply is scored


def test_scores_follow_the_utterance_not_the_format() -> None:
    """Two registers whose adapters learnt the format alike (a big gain over the base) but whose
    utterances the rival adapter predicts as well: separability on utterance tokens is not 1.0,
    and every cell says how many conversations and tokens it rests on."""
    rng = np.random.default_rng(0)
    columns = [BASE, "a", "b"]
    sums, counts = {}, {}
    for data in ("a", "b"):
        n = 20
        tokens = np.array([[40, 0, 12]] * n)  # utterance, fields, format tokens per conversation
        per_token = np.zeros((n, 3, 3))
        per_token[:, :, 0] = 5.0 + rng.normal(0, 0.2, (n, 1))  # utterance: no adapter helps
        per_token[:, 1:, 2] = 2.0  # format: both adapters far better than the base
        per_token[:, 0, 2] = 7.0
        if data == "b":
            per_token[:, 2, 0] -= 0.3  # only b's adapter knows b's voice
        sums[data] = per_token * tokens[:, None, :]
        counts[data] = tokens
    scores = score(columns, sums, counts, seed=0)
    utterance, fmt = scores["utterance"], scores["format"]
    assert utterance.separability.value == 0.5  # b's own adapter wins, a's does not
    assert utterance.mean_gain.value == pytest.approx(0.15, abs=0.01)
    assert fmt.mean_gain.value == pytest.approx(5.0)
    assert utterance.margins["b"].low > 0.25 and utterance.margins["a"].value <= 0
    cell = utterance.matrix["a"]["a"]
    assert (cell.n, cell.tokens) == (20, 800) and cell.low <= cell.loss <= cell.high
    fields = scores["fields"]  # no field tokens: no figure, not 0
    assert np.isnan(fields.mean_gain.value) and np.isnan(fields.separability.value)


def _train_loras_run(client: MlflowClient):  # noqa: ANN202
    exp = client.get_experiment_by_name("nimmer-run_all")
    (parent,) = [
        r for r in client.search_runs([exp.experiment_id]) if r.data.tags.get("stage") == "train_loras"
    ]
    return parent


@pytest.mark.slow
def test_matrix_metrics_intervals_and_n_in_mlflow(tiny_run: Path) -> None:
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run / 'mlflow.db'}")
    parent = _train_loras_run(client)
    metrics = parent.data.metrics
    for name in ("r1", "r0"):
        for cls in ("utterance", "format"):
            for metric in ("separability", "mean_gain"):
                key = f"{metric}.{name}.{cls}"
                assert metrics[f"{key}_low"] <= metrics[key] <= metrics[f"{key}_high"]
        assert all(metrics[f"n.{name}.{r}"] >= 5 for r in TWO)
    # the format is most of the gain: what the old all-token figure mostly measured
    assert metrics["mean_gain.r1.format"] > 3 * metrics["mean_gain.r1.utterance"]
    csv = Path(
        client.download_artifacts(parent.info.run_id, "evaluation/heldout_loss_r0_utterance.csv")
    ).read_text()
    header, *rows = csv.strip().splitlines()
    assert header.split(",") == ["data", "n", "tokens", BASE, *TWO] and len(rows) == 2
    summary = json.loads((_adapters(tiny_run)["drunk-scavenger"].parent / EVALUATION).read_text())
    assert summary["adapters"].keys() == set(TWO)
    assert (
        summary["scores"]["r1"]["utterance"]["separability"]["value"] == metrics["separability.r1.utterance"]
    )


@pytest.mark.slow
def test_model_card_shows_separability_gain_intervals_and_n(tiny_run: Path) -> None:
    card = (tiny_run / "releases" / "nimmerworld-base-v1" / "README.md").read_text()
    section = card.split("## Register LoRA evaluation", 1)[1].split("\n## ", 1)[0]
    assert "utterance tokens" in section and "**r1**" in section and "**r0**" in section
    client = MlflowClient(tracking_uri=f"sqlite:///{tiny_run / 'mlflow.db'}")
    metrics = _train_loras_run(client).data.metrics
    sep = metrics["separability.r1.utterance"]
    assert f"separability {sep:.2f} [" in section
    for register in TWO:
        assert f"| {register} | {int(metrics[f'n.r1.{register}'])} |" in section


@pytest.mark.slow
def test_evaluation_samples_stop_at_the_end_of_turn_token(tiny_run: Path) -> None:
    base = base_dir(tiny_run)
    model = load_all(base, list(_adapters(tiny_run).values()))
    tokenizer = AutoTokenizer.from_pretrained(base)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def hook(module, args, output):  # noqa: ANN001, ANN202
        output.logits[..., im_end] = 1e4
        return output

    handle = model.get_base_model().register_forward_hook(hook)
    conversation = [
        {"role": "system", "content": '{"role":"a drunk scavenger"}'},
        {"role": "user", "content": "Where did the water go?"},
        {"role": "assistant", "content": render_reply(REPLY)},
    ]
    settings = config("experiment=ci_tiny", "lora.sample_max_new_tokens=24").lora
    try:
        sample = _sample(model, tokenizer, "drunk-scavenger", conversation, config().registers, settings)
    finally:
        handle.remove()
    assert sample["tokens"] == 1 and sample["ended_turn"] and sample["generated"] == ""
