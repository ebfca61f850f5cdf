"""A signed, published version built here in seconds: a fresh model from config (tokenizer
trained here), or a pretrained HF folder (e.g. SmolLM2 converted from its GGUF), and one register
LoRA per name, each with random non-zero weights so that every register really speaks
differently (PEFT's default init would make each a no-op)."""

from __future__ import annotations

from pathlib import Path

from nimmer_train.config import ModelConfig

REGISTERS = (
    "caste-preacher",
    "drunk-scavenger",
    "hivemind-broadcast",
    "imperial-ceremony-chorus",
    "clasp-confession",
)


def publish_registers(
    root: Path,
    registers: tuple[str, ...] = REGISTERS[:3],
    model: ModelConfig | None = None,
    vocab: int = 512,
    pretrained: Path | None = None,
) -> tuple[Path, Path]:
    """(releases, trusted keys) of version v1 with a LoRA (r=8, attention and MLP) per register,
    on a model built from ``model`` or, given ``pretrained``, on that folder's weights."""
    import torch
    from peft import LoraConfig, get_peft_model

    from nimmer_train.artifacts import write_json_atomic, write_manifest
    from nimmer_train.base.modeling import build_model
    from nimmer_train.base.tokenizer import train_bpe
    from nimmer_train.federation.client import example_text
    from nimmer_train.loras.adapters import METADATA, base_identity
    from nimmer_train.memory.synthetic import heldout_examples
    from nimmer_train.publish.release import PublishRequest, publish_version
    from nimmer_train.publish.signing import generate_key

    cfg = model or ModelConfig(name="tiny")
    if pretrained is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        net = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(pretrained)
    else:
        tokenizer = train_bpe(
            [example_text(e) for e in heldout_examples(2000, seed=1)], vocab, cfg.max_position_embeddings
        )
        torch.manual_seed(0)
        net = build_model(cfg, len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id, 0)
    base = save_base(net, tokenizer, cfg, root / "base" / "tiny-serve", root, f"serve-base-{cfg.name}")
    adapters = []
    for i, register in enumerate(registers):
        torch.manual_seed(100 + i)
        lora = LoraConfig(
            r=8, lora_alpha=16, target_modules=list(cfg.lora_target_modules), init_lora_weights=False
        )
        peft = get_peft_model(net, lora)
        folder = root / "adapters" / register
        peft.save_pretrained(folder)
        net = peft.unload()  # the bare base again for the next register
        write_json_atomic(folder / METADATA, {"register": register, "base": base_identity(base)})
        write_manifest(folder, "register_adapter", f"serve-{register}", {})
        adapters.append(folder)
    key = root / "keys" / "publisher.key"
    generate_key(key, root / "keys" / "trusted")
    publish_version(root / "releases", key, PublishRequest(base, adapters))
    return root / "releases", root / "keys" / "trusted"


def save_base(net, tokenizer, cfg: ModelConfig, folder: Path, root: Path, name: str) -> Path:  # noqa: ANN001
    """A base built here saved as the base stage would, with a manifest whose lineage says it
    came from no corpus (what publish needs to sign it)."""
    from nimmer_train.artifacts import write_manifest

    net.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    lineage = {
        "dataset_fingerprint": "0" * 64,
        "dataset_dir": str(root / "no-corpus" / "dataset"),
        "config_hash": "0" * 64,
        "git_commit": "test",
        "model": {"name": cfg.name, "family": cfg.family},
        "train": {},
        "metrics": {"parameters": sum(p.numel() for p in net.parameters())},
    }
    write_manifest(folder, "base", name, lineage)
    return folder
