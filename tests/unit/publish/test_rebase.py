"""LoRAs carried across versions (issue 25, item 2): before the next version is signed, each LoRA
of the one before is inherited, retrained or refused by the rule on the register x adapter matrix
(utterance tokens) on its weights; the signed manifest lists exactly the LoRAs that fit, and the
registry records each decision with its evidence; a major release never inherits. Everything is
built here in seconds: a tiny base from config, a tokenizer trained here, r1 and literary
datasets written as the stages write them, two LoRAs with random weights whose metadata records
that data and a recipe, and signed versions."""

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
from nimmer_train.loras.adapters import METADATA, base_identity, read_metadata
from nimmer_train.publish.rebase import Carry, architecture_change, carry, rebase
from nimmer_train.publish.registry import Registry, release_label
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import CompatibilityError, VerifiedVersion, check_lora, open_version
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
def published(tmp_path: Path) -> Published:
    """v1 (base A with both LoRAs, signed and registered) and the means to publish the next."""
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
    return Published(tmp_path, releases, artifacts, key, tokenizer)


@dataclasses.dataclass
class Published:
    root: Path
    releases: Path
    artifacts: Path
    key: Path
    tokenizer: object

    def base(self, name: str, layers: int = 2, seed: int = 1) -> Path:
        return _base(self.root, name, layers, seed, self.tokenizer)

    def carry(
        self, base: Path, settings: RebaseConfig, own: list[Path] = (), candidates: list[Path] = ()
    ) -> Carry:
        registers = config().registers
        found = carry(
            self.releases, self.artifacts, base, list(own), settings, registers, self.keys(), candidates
        )
        assert found is not None
        return found

    def publish(self, base: Path, found: Carry) -> str:
        from nimmer_train.publish.release import PublishRequest, publish_version

        version, new = publish_version(self.releases, self.key, PublishRequest(base, carry=found))
        assert new
        return version.label

    def keys(self) -> Keyring:
        return Keyring.load(self.root / "keys" / "trusted")

    def open(self, name: str) -> VerifiedVersion:
        return open_version(self.releases, name, self.keys())


def _recorded(releases: Path, target: str) -> dict[str, dict]:
    registry = Registry.open(releases)
    try:
        return {r["register"]: r for r in registry.rebases_into(registry.find(target))}
    finally:
        registry.close()


def test_a_minor_release_inherits_or_retrains_each_lora_by_the_rule_before_it_is_signed(
    published: Published,
) -> None:
    base_b = published.base("b")
    lenient = published.carry(base_b, RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False))
    assert (lenient.bump, lenient.previous.label) == ("minor", "nimmerworld-base-v1")
    assert {d.decision for d in lenient.decisions} == {"inherited-evaluated"}
    gains = {}
    for d in lenient.decisions:
        cells = d.evidence["cells"]  # the matrix cells the rule used, each with its n and tokens
        assert cells["own"]["n"] == 4 and cells["own"]["tokens"] > 0
        assert d.evidence["gain"] == pytest.approx(cells["base"]["loss"] - cells["own"]["loss"])
        rival = cells["best_rival"]
        assert rival["adapter"] == next(r for r in REGISTERS if r != d.register)
        assert d.evidence["margin"] == pytest.approx(rival["loss"] - cells["own"]["loss"])
        gains[d.register] = d.evidence["gain"]

    # a threshold between the two gains: the better LoRA is inherited, the other retrained on
    # base B's weights; the version is signed with exactly those two
    low, high = sorted(gains, key=gains.get)
    assert gains[low] < gains[high]
    split = RebaseConfig(min_gain=(gains[low] + gains[high]) / 2, min_margin=-1e9, retrain=True)
    found = published.carry(base_b, split)
    decided = {d.register: d for d in found.decisions}
    assert decided[high].decision == "inherited-evaluated"
    assert decided[low].decision == "rebased" and "does not fit" in decided[low].reason
    assert f"gain {gains[low]:+.3f}" in decided[low].reason
    retrained = Path(decided[low].rebased_adapter)
    weights_b = base_identity(base_b)["weights_sha256"]
    assert read_metadata(retrained)["base"]["weights_sha256"] == weights_b
    assert read_metadata(retrained)["lora"]["max_steps"] == RECIPE.max_steps  # its recorded recipe

    label = published.publish(base_b, found)
    v2 = published.open(label)
    signed = {c["register"]: c for c in v2.manifest["compatible_loras"]}
    assert (signed[high]["relation"], signed[high]["lora_id"]) == ("inherited", decided[high].lora_id)
    assert signed[low]["relation"] == "trained_on" and signed[low]["lora_id"] != decided[low].lora_id
    assert set(v2.loras) == set(REGISTERS) and v2.loras[low].name == signed[low]["lora_id"]
    carried = v2.manifest["lora_carry"]  # the decisions are signed with the version
    assert (carried["from"], carried["bump"]) == ("nimmerworld-base-v1", "minor")
    assert {d["register"]: d["decision"] for d in carried["decisions"]} == {
        high: "inherited-evaluated",
        low: "rebased",
    }
    rows = _recorded(published.releases, label)
    assert {r: rows[r]["decision"] for r in REGISTERS} == {high: "inherited-evaluated", low: "rebased"}
    assert rows[low]["rebased_adapter"] == str(retrained)
    assert rows[high]["evidence"]["gain"] == pytest.approx(gains[high])
    assert (rows[high]["evidence"]["bump"], rows[high]["evidence"]["from"]) == (
        "minor",
        "nimmerworld-base-v1",
    )
    reported = rebase(published.releases, label)
    assert reported is not None and reported.release == (1, 1)
    assert release_label(reported.target, reported.release) == "nimmerworld-base-v2 (1.1)"

    # without retraining, a LoRA that fails the rule is refused: the next version is signed without
    # it, loading it onto that version is refused, and the registry says why
    base_c = published.base("c", seed=2)
    refuse = published.carry(base_c, RebaseConfig(min_gain=1e9, min_margin=-1e9, retrain=False))
    assert {d.decision for d in refuse.decisions} == {"refused"}
    v3 = published.open(published.publish(base_c, refuse))
    assert v3.manifest["compatible_loras"] == [] and v3.loras == {}
    assert all("retrain is false" in r["reason"] for r in _recorded(published.releases, v3.label).values())
    with pytest.raises(CompatibilityError, match="not nimmerworld-base-v3"):
        check_lora(published.releases, "v3", v2.loras[high])


def test_a_major_release_never_inherits(published: Published) -> None:
    base_c = published.base("c", layers=3, seed=2)
    v1 = published.open("v1")
    assert architecture_change(v1.folder, published.base("b")) is None
    assert "num_hidden_layers" in (architecture_change(v1.folder, base_c) or "")
    lenient = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)  # would inherit anything
    found = published.carry(base_c, lenient)
    assert found.bump == "major" and {d.decision for d in found.decisions} == {"refused"}
    assert all("major release invalidates inherited LoRAs" in d.reason for d in found.decisions)
    assert all("cells" not in d.evidence for d in found.decisions)  # nothing evaluated
    # publish.rebase.major=true makes a same-architecture version a major release too
    forced = published.carry(published.base("d", seed=3), dataclasses.replace(lenient, major=True))
    assert forced.bump == "major" and {d.decision for d in forced.decisions} == {"refused"}
    label = published.publish(base_c, found)
    result = rebase(published.releases, label)
    assert result is not None and (result.bump, result.release) == ("major", (2, 0))
    assert release_label(result.target, result.release) == "nimmerworld-base-v2 (2.0)"
    rows = _recorded(published.releases, label)
    assert json.loads(json.dumps(rows["hivemind-broadcast"]["evidence"]))["bump"] == "major"


def test_a_lora_trained_on_the_new_weights_supersedes_the_inherited_one(published: Published) -> None:
    base_b = published.base("b")
    own = _loras(published.root / "own", base_b, {"synth": "a" * 64, "corpus": "b" * 64})[:1]
    lenient = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)
    found = carry(
        published.releases, published.artifacts, base_b, own, lenient, config().registers, published.keys()
    )
    assert found is not None
    decided = {d.register: d for d in found.decisions}
    assert decided[REGISTERS[0]].decision == "refused" and "superseded" in decided[REGISTERS[0]].reason
    assert decided[REGISTERS[1]].decision == "inherited-evaluated"


def test_a_merge_retrains_the_inherited_loras_when_asked(published: Published) -> None:
    """publish.rebase.retrain_after_merge: when the new weights merge a register's adapter, no
    inherited LoRA fits, whatever the loss rule says (real_small's v2 kept four LoRAs by the rule
    at register accuracy 0.57; retrained, 0.72): each is retrained, or refused without retraining.
    Off (the default), the rule decides."""
    merged, other = REGISTERS
    base_b = published.base("b")
    lenient = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)  # the rule fits anything

    def decide(settings: RebaseConfig) -> dict[str, object]:
        found = carry(
            published.releases,
            published.artifacts,
            base_b,
            [],
            settings,
            config().registers,
            published.keys(),
            merged_register=merged,
        )
        assert found is not None and found.bump == "minor"
        return {d.register: d for d in found.decisions}

    by_rule = decide(lenient)
    assert by_rule[merged].decision == "refused" and "would apply twice" in by_rule[merged].reason
    assert by_rule[other].decision == "inherited-evaluated" and "cells" in json.dumps(by_rule[other].evidence)
    after = decide(dataclasses.replace(lenient, retrain_after_merge=True))
    assert after[other].decision == "refused" and after[other].evidence == {}  # nothing evaluated
    assert f"merge {merged}'s voice (publish.rebase.retrain_after_merge)" in after[other].reason
    retrained = decide(dataclasses.replace(lenient, retrain_after_merge=True, retrain=True))[other]
    assert retrained.decision == "rebased" and "does not fit, retrained" in retrained.reason
    assert (
        read_metadata(Path(retrained.rebased_adapter))["base"]["weights_sha256"]
        == base_identity(base_b)["weights_sha256"]
    )


def test_a_population_adapter_merged_into_the_weights_leaves_every_register_its_lora(
    published: Published,
) -> None:
    """federated.start_rank > 0: the federation trains a fresh small adapter (experiment=demo),
    not a register's voice. Merged into v2 it is the base's change: the rule decides every v1
    LoRA on the merged weights, its own register's too (a register's adapter merged is refused as
    'would apply twice'), v2 lists all of them, the runtime and the voice report before signing
    speak that register through its LoRA (the report once spoke it with the bare merged weights:
    caste-preacher 0.12 in make demo's v2), the sign-off's carry goal passes and the card says
    what was merged."""
    from safetensors.torch import load_file, save_file

    from nimmer_train.artifacts import merged_voice
    from nimmer_train.config.federated import FederatedConfig
    from nimmer_train.federation.start import fresh_start_adapter
    from nimmer_train.publish.release import PublishRequest, publish_version, stage_merge
    from nimmer_train.publish.signoff import PASS, carry_goal
    from nimmer_train.runtime.voice_eval import candidate_model

    base_a = published.root / "artifacts" / "base" / "a"
    start = FederatedConfig(start_rank=1, start_layers=1)
    fresh = fresh_start_adapter(base_a, start, REGISTERS[0], published.root / "federated")
    weights = fresh / "adapter_model.safetensors"
    tensors = load_file(weights)
    torch.manual_seed(3)
    save_file(
        {k: v + 0.05 * torch.randn_like(v) if "lora_B" in k else v for k, v in tensors.items()}, weights
    )
    write_manifest(
        fresh, "register_adapter", "d" * 64, {}
    )  # the trained adapter, as the federation publishes it
    meta = read_metadata(fresh)
    assert meta["register"] == REGISTERS[0] and merged_voice(meta) is None

    req = PublishRequest(base_a, merge_adapter=fresh)
    merged = stage_merge(req, published.artifacts)
    lenient = RebaseConfig(min_gain=-1e9, min_margin=-1e9, retrain=False)
    found = carry(
        published.releases, published.artifacts, merged, [], lenient, config().registers, published.keys(),
        merged_register=merged_voice(meta),
    )  # fmt: skip
    assert found is not None
    assert {d.register: d.decision for d in found.decisions} == dict.fromkeys(
        REGISTERS, "inherited-evaluated"
    )
    candidate = dataclasses.replace(req, merged_dir=merged, carry=found)
    with candidate_model(candidate) as model:  # what the voice report speaks through before signing
        assert model.merged_register is None and set(model.registers) == set(REGISTERS)
        assert model.adapter_for(REGISTERS[0]) == REGISTERS[0]
    version, new = publish_version(published.releases, published.key, candidate)
    assert new
    v2 = published.open(version.label)
    manifest = v2.manifest
    assert manifest["merged_adapter"]["fresh_start"] == {
        "rank": 1,
        "layers": 1,
        "targets": ["q_proj", "v_proj"],
    }
    assert {(c["register"], c["relation"]) for c in manifest["compatible_loras"]} == {
        (r, "inherited") for r in REGISTERS
    }
    assert merged_voice(manifest["merged_adapter"]) is None and set(v2.loras) == set(REGISTERS)
    assert carry_goal(v2.folder, manifest).status == PASS
    assert "every register keeps its LoRA" in (v2.folder / "README.md").read_text()
