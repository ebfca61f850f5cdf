"""LoRAs carried across versions (issue 25, item 2): after a second version, the rebase stage
inherits, retrains or refuses each LoRA of the first by the rule on the register x adapter matrix
(utterance tokens), and the registry records the decision with its evidence; a major release
never inherits. Everything is built here in seconds: a tiny base from config, a tokenizer trained
here, r1 and literary datasets written as the stages write them, two LoRAs with random weights
whose metadata records that data and a recipe, and three signed versions."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict

from nimmer_train.artifacts import write_json_atomic, write_manifest
from nimmer_train.config import LoraConfig, ModelConfig
from nimmer_train.config.schema import RebaseConfig
from nimmer_train.errors import NimmerError
from nimmer_train.loras.adapters import METADATA, base_identity, read_metadata
from nimmer_train.publish.rebase import architecture_change, rebase
from nimmer_train.publish.registry import Registry, release_label
from nimmer_train.synth.synthesize import VALIDATION, VALIDATION_UNFILTERED
from nimmer_train.voice.prompt_dsl import render_reply
from tests.helpers.compose import config
from tests.helpers.published import save_base

REGISTERS = ("hivemind-broadcast", "drunk-scavenger")
WORDS = {
    "hivemind-broadcast": "we are the lamps we are the corridor return citizen the choir hums",
    "drunk-scavenger": "gimme that bottle rust and rags heh the scrap pile sings tonight mate",
}
RECIPE = LoraConfig(rank=4, alpha=8, max_steps=2, batch_size=2, warmup_steps=0, max_length=200, save_steps=50)


def _conversation(register: str, i: int) -> list[dict[str, str]]:
    words = WORDS[register].split()
    utterance = " ".join(words[(i + k) % len(words)] for k in range(8))
    reply = render_reply({"utterance": utterance, "emotion": "low", "gesture": "a nod"})
    return [
        {"role": "system", "content": f'{{"role":"{register}"}}'},
        {"role": "user", "content": f"where is the water {i}"},
        {"role": "assistant", "content": reply},
    ]


def _datasets(artifacts: Path) -> dict[str, str]:
    """An r1 corpus and a literary corpus where the stages put them, named by fingerprint."""
    fps = {"synth": "a" * 64, "corpus": "b" * 64}
    rows = {
        split: [{"register": r, "messages": _conversation(r, i + off)} for r in REGISTERS for i in range(n)]
        for split, n, off in (("train", 6, 0), (VALIDATION, 4, 20), (VALIDATION_UNFILTERED, 4, 40))
    }
    synth = artifacts / "synth" / f"demo-{fps['synth'][:12]}"
    DatasetDict({k: Dataset.from_list(v) for k, v in rows.items()}).save_to_disk(str(synth / "r1"))
    write_manifest(synth, "synth", fps["synth"], {})
    corpus = artifacts / "corpus" / f"literary-{fps['corpus'][:12]}"
    passage = {"work": "nowhere", "title": "T", "author": "A", "text": "a passage " * 20}
    DatasetDict({"train": Dataset.from_list([passage])}).save_to_disk(str(corpus / "dataset"))
    write_manifest(corpus, "corpus", fps["corpus"], {})
    return fps


def _base(root: Path, name: str, layers: int, seed: int, tokenizer) -> Path:  # noqa: ANN001
    from nimmer_train.base.modeling import build_model

    cfg = ModelConfig(
        name="tiny", vocab_size=400, hidden_size=32, intermediate_size=64, num_hidden_layers=layers
    )
    torch.manual_seed(seed)
    net = build_model(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, seed)
    return save_base(net, tokenizer, cfg, root / "artifacts" / "base" / name, root, f"base-{name}")


def _loras(root: Path, base: Path, fps: dict[str, str]) -> list[Path]:
    """A LoRA per register with random non-zero weights, recording its data and recipe as the
    train_loras stage does."""
    from peft import LoraConfig as PeftLora
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(base)
    modules = ["q_proj", "v_proj"]
    out = []
    for i, register in enumerate(REGISTERS):
        torch.manual_seed(100 + i)
        peft = get_peft_model(
            net, PeftLora(r=4, lora_alpha=8, target_modules=modules, init_lora_weights=False)
        )
        folder = root / "adapters" / register
        peft.save_pretrained(folder)
        net = peft.unload()
        meta = {
            "register": register,
            "traits": {},
            "base": base_identity(base),
            "datasets": fps,
            "lora": dataclasses.asdict(RECIPE),
            "target_modules": modules,
        }
        write_json_atomic(folder / METADATA, meta)
        write_manifest(folder, "register_adapter", f"{'c' * 60}{i:04d}", {})
        out.append(folder)
    return out


@pytest.fixture
def versions(tmp_path: Path) -> tuple[Path, Path]:
    """(releases, artifacts) with v1 (base A + both LoRAs), v2 (base B: same architecture, other
    weights, no LoRAs) and v3 (base C: one more layer)."""
    from nimmer_train.base.tokenizer import train_bpe
    from nimmer_train.publish.release import PublishRequest, publish_version
    from nimmer_train.publish.signing import generate_key

    texts = [m["content"] for r in REGISTERS for i in range(60) for m in _conversation(r, i)]
    tokenizer = train_bpe(texts * 3, 400, 256)
    artifacts = tmp_path / "artifacts"
    fps = _datasets(artifacts)
    base_a = _base(tmp_path, "a", 2, 0, tokenizer)
    key = tmp_path / "keys" / "publisher.key"
    generate_key(key, tmp_path / "keys" / "trusted")
    releases = tmp_path / "releases"
    publish_version(releases, key, PublishRequest(base_a, _loras(tmp_path, base_a, fps)))
    publish_version(releases, key, PublishRequest(_base(tmp_path, "b", 2, 1, tokenizer)))
    publish_version(releases, key, PublishRequest(_base(tmp_path, "c", 3, 2, tokenizer)))
    return releases, artifacts


def _recorded(releases: Path, target: str) -> dict[str, dict]:
    registry = Registry.open(releases)
    try:
        return {r["register"]: r for r in registry.rebases_into(registry.find(target))}
    finally:
        registry.close()


def test_a_minor_release_inherits_or_retrains_each_lora_by_the_rule(versions: tuple[Path, Path]) -> None:
    releases, artifacts = versions
    catalogue = config().registers
    lenient = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)
    first = rebase(releases, artifacts, "v2", catalogue, lenient)
    assert first is not None and (first.bump, first.release, first.previous) == (
        "minor",
        (1, 1),
        "nimmerworld-base-v1",
    )
    assert {d.decision for d in first.decisions} == {"inherited-evaluated"}
    rows = _recorded(releases, "v2")
    gains = {}
    for register in REGISTERS:
        evidence = rows[register]["evidence"]
        cells = evidence["cells"]  # the matrix cells the rule used, each with its n and tokens
        assert cells["own"]["n"] == 4 and cells["own"]["tokens"] > 0
        assert evidence["gain"] == pytest.approx(cells["base"]["loss"] - cells["own"]["loss"])
        rival = cells["best_rival"]
        assert rival["adapter"] == next(r for r in REGISTERS if r != register)
        assert evidence["margin"] == pytest.approx(rival["loss"] - cells["own"]["loss"])
        assert (evidence["bump"], evidence["from"], evidence["to"]) == (
            "minor",
            "nimmerworld-base-v1",
            "nimmerworld-base-v2",
        )
        gains[register] = evidence["gain"]
    assert rebase(releases, artifacts, "v2", catalogue, lenient).reused  # same rule: nothing recomputed

    # a threshold between the two gains: the better LoRA stays, the other is retrained on v2's weights
    low, high = sorted(gains, key=gains.get)
    assert gains[low] < gains[high]
    split = RebaseConfig(min_gain=(gains[low] + gains[high]) / 2, min_margin=-1e9, retrain=True)
    second = rebase(releases, artifacts, "v2", catalogue, split)
    assert second is not None and not second.reused
    decided = {d.register: d for d in second.decisions}
    assert decided[high].decision == "inherited-evaluated"
    assert decided[low].decision == "rebased" and "does not fit" in decided[low].reason
    assert f"gain {gains[low]:+.3f}" in decided[low].reason
    retrained = Path(decided[low].rebased_adapter)
    registry = Registry.open(releases)
    try:
        v2 = registry.find("v2")
        assert read_metadata(retrained)["base"]["weights_sha256"] == v2.row["weights_sha256"]
        assert read_metadata(retrained)["lora"]["max_steps"] == RECIPE.max_steps  # its recorded recipe
    finally:
        registry.close()
    rows = _recorded(releases, "v2")
    assert {r: rows[r]["decision"] for r in REGISTERS} == {high: "inherited-evaluated", low: "rebased"}
    assert rows[low]["rebased_adapter"] == str(retrained)

    # without retraining, a LoRA that fails the rule is refused, and the registry says why
    refuse = RebaseConfig(min_gain=1e9, min_margin=-1e9, retrain=False)
    third = rebase(releases, artifacts, "v2", catalogue, refuse)
    assert third is not None and {d.decision for d in third.decisions} == {"refused"}
    assert all("retrain is false" in r["reason"] for r in _recorded(releases, "v2").values())


def test_a_major_release_never_inherits(versions: tuple[Path, Path]) -> None:
    releases, artifacts = versions
    catalogue = config().registers
    registry = Registry.open(releases)
    try:
        v1, v2, v3 = registry.versions()
        assert architecture_change(v1, v2) is None
        assert "num_hidden_layers" in (architecture_change(v2, v3) or "")
    finally:
        registry.close()
    lenient = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)  # would inherit anything
    result = rebase(releases, artifacts, "v3", catalogue, lenient, previous_name="v1")
    assert result is not None and (result.bump, result.release) == ("major", (2, 0))
    assert release_label(result.target, result.release) == "nimmerworld-base-v3 (2.0)"
    rows = _recorded(releases, "v3")
    assert {r["decision"] for r in rows.values()} == {"refused"}
    assert all("major release invalidates inherited LoRAs" in r["reason"] for r in rows.values())
    assert all(r["evidence"]["bump"] == "major" and "cells" not in r["evidence"] for r in rows.values())
    # a forced major on a minor release: v2 was already recorded 1.1, so forcing it is refused
    with pytest.raises(NimmerError, match="already release 1.1"):
        rebase(releases, artifacts, "v2", catalogue, dataclasses.replace(lenient, major=True))
    assert json.loads(json.dumps(rows["hivemind-broadcast"]["evidence"]))["release"] == "2.0"
