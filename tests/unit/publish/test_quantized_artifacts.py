"""Every release ships its base as GGUF (Q8_0, Q4_1) and each register LoRA as a GGUF adapter,
converted here with gguf-py and llama.cpp's own quantizer (the llama-cpp-cffi wheel): the
unquantized conversion's logits agree with PyTorch's, base and LoRA; the files are signed with
every other file, so a quantized file altered or missing refuses the version by name (on load
and on ``versions pull``); a LoRA converted for another base is one clear line.

Tolerances: the F32 GGUF's last-position logits within 1e-3 x the logits' largest magnitude of
PyTorch's float32 (llama.cpp sums in another order; measured about 2e-5 here, 4e-4 on
SmolLM2-135M); Q8_0 keeps the top token and a correlation over 0.99."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nimmer_train.publish.manifest import IntegrityError
from nimmer_train.publish.pull import PullError, pull_version
from nimmer_train.publish.quantize import quantize, read_base_key, write_base_gguf, write_lora_gguf
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import open_version
from nimmer_train.runtime.llama_engine import LlamaContext
from tests.helpers.published import publish_registers

V1 = "nimmerworld-base-v1"
REGISTER = "caste-preacher"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("quantized")
    publish_registers(root, registers=(REGISTER, "drunk-scavenger"))
    return root


def _prompt(folder: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "user", "content": "What news from the gate tonight?"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def _torch_logits(base: Path, ids: list[int], adapter: Path | None = None) -> np.ndarray:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    with torch.no_grad():
        return model.eval()(torch.tensor([ids])).logits[0, -1].numpy()


def _close(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max()


def test_f32_conversion_matches_pytorch_base_and_lora_and_q8_keeps_the_top_token(
    published: Path, tmp_path: Path
) -> None:
    base, adapter = published / "base" / "tiny-serve", published / "adapters" / REGISTER
    ids = _prompt(base)
    f32 = write_base_gguf(base, tmp_path / "base.f32.gguf", "base-a")
    lora = write_lora_gguf(adapter, base, tmp_path / "lora.gguf", "base-a")
    ref_base, ref_lora = _torch_logits(base, ids), _torch_logits(base, ids, adapter)
    assert np.abs(ref_base - ref_lora).max() > 0.1  # the LoRA really changes the logits
    ctx = LlamaContext(f32, n_ctx=256, threads=1)
    try:
        _close(ctx.prefill(ids, None), ref_base)
        ctx.load_adapter(REGISTER, lora)
        _close(ctx.prefill(ids, REGISTER), ref_lora)
        _close(ctx.prefill(ids, None), ref_base)  # the adapter is cleared again for the bare base
    finally:
        ctx.close()
    q8 = quantize(f32, tmp_path / "base.q8_0.gguf", "q8_0")
    assert q8.stat().st_size < f32.stat().st_size and read_base_key(q8) == "base-a"
    ctx = LlamaContext(q8, n_ctx=256, threads=1)
    try:
        got = ctx.prefill(ids, None)
    finally:
        ctx.close()
    assert got.argmax() == ref_base.argmax() and np.corrcoef(got, ref_base)[0, 1] > 0.99


def test_a_lora_converted_for_another_base_is_refused_by_name(published: Path, tmp_path: Path) -> None:
    base, adapter = published / "base" / "tiny-serve", published / "adapters" / REGISTER
    f32 = write_base_gguf(base, tmp_path / "base.f32.gguf", "base-a")
    other = write_lora_gguf(adapter, base, tmp_path / "other.lora.gguf", "base-b")
    ctx = LlamaContext(f32, n_ctx=64, threads=1)
    try:
        with pytest.raises(Exception, match=r"other\.lora\.gguf: LoRA converted for base base-b"):
            ctx.load_adapter(REGISTER, other)
    finally:
        ctx.close()


def test_the_release_signs_a_gguf_per_quant_and_per_register(published: Path) -> None:
    manifest = json.loads((published / "releases" / V1 / "manifest.json").read_text())
    section = manifest["quantized"]
    assert section["bases"] == {"q8_0": "quantized/base.q8_0.gguf", "q4_1": "quantized/base.q4_1.gguf"}
    assert sorted(section["loras"]) == ["caste-preacher", "drunk-scavenger"]
    listed = {f["path"] for f in manifest["blob_distribution"]["files"]}
    assert {*section["bases"].values(), *section["loras"].values()} <= listed
    assert not any(p.endswith(".f32.gguf") or p.endswith(".part") for p in listed)
    for rel in [*section["bases"].values(), *section["loras"].values()]:
        assert read_base_key(published / "releases" / V1 / rel) == section["base_sha256"]


@pytest.mark.parametrize("damage", ["altered", "missing"])
def test_a_quantized_file_altered_or_missing_refuses_the_version_by_name(
    published: Path, tmp_path: Path, damage: str
) -> None:
    releases = tmp_path / "releases"
    shutil.copytree(published / "releases", releases)
    target = releases / V1 / "quantized" / "base.q4_1.gguf"
    if damage == "missing":
        target.unlink()
    else:
        data = bytearray(target.read_bytes())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
    trusted = Keyring.load(published / "keys" / "trusted")
    with pytest.raises(IntegrityError, match=r"quantized/base\.q4_1\.gguf"):
        open_version(releases, "v1", trusted)
    with pytest.raises((IntegrityError, PullError), match=r"quantized/base\.q4_1\.gguf"):  # pull too
        pull_version(tmp_path / "device" / "releases", str(releases / V1), trusted)
    assert not (tmp_path / "device" / "releases" / V1).exists()


def test_a_model_llama_cpp_cannot_quantize_ships_its_base_in_f16(tmp_path: Path) -> None:
    from nimmer_train.config import ModelConfig
    from nimmer_train.runtime.quantized_model import NoQuantizedArtifacts, QuantizedModel
    from nimmer_train.voice.sampling import SamplingKnobs

    odd = ModelConfig(name="odd", hidden_size=64, intermediate_size=176, num_attention_heads=4)
    releases, trusted = publish_registers(tmp_path, registers=(REGISTER,), model=odd)  # ci_tiny's widths
    section = json.loads((releases / V1 / "manifest.json").read_text())["quantized"]
    assert section["bases"] == {"f16": "quantized/base.f16.gguf"} and list(section["loras"]) == [REGISTER]
    with pytest.raises(NoQuantizedArtifacts, match="ships f16, not q8_0"):
        QuantizedModel.open(releases, "v1", trusted)
    model = QuantizedModel.open(releases, "v1", trusted, "f16", threads=1)
    try:
        knobs = SamplingKnobs(0.8, 0.9, 40, 1.0, 0.0, max_new_tokens=4)
        assert model.generate([{"role": "user", "content": "hi"}], REGISTER, knobs, seed=1).completion_tokens
    finally:
        model.close()
