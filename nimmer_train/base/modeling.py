"""The base causal LM: a Llama built from config, or a pretrained checkpoint loaded for
continued pretraining (every weight, or a LoRA merged back in: :func:`with_lora`, :func:`merged`)."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from nimmer_train.config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def llama_config(cfg: ModelConfig, vocab_size: int, eos_id: int, pad_id: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        attention_dropout=0.0,
    )


def build_model(cfg: ModelConfig, vocab_size: int, eos_id: int, pad_id: int, seed: int) -> PreTrainedModel:
    """A fresh Llama from config (weights drawn from ``seed``) or the checkpoint at name_or_path.

    Weights stay in float32; a bfloat16 model dtype trains under bf16 autocast (see pretrain).
    """
    if cfg.name_or_path:
        model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, dtype=torch.float32)
        if model.get_input_embeddings().num_embeddings < vocab_size:
            model.resize_token_embeddings(vocab_size)
    else:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(llama_config(cfg, vocab_size, eos_id, pad_id))
    if cfg.gradient_checkpointing:  # renamed activation_checkpointing_enable in transformers 5
        enable = getattr(model, "activation_checkpointing_enable", None)
        (enable or model.gradient_checkpointing_enable)()
        model.config.use_cache = False
    return model


def with_lora(model: PreTrainedModel, cfg: ModelConfig) -> torch.nn.Module:
    """``model`` wrapped in a trainable LoRA of rank ``cfg.continued_lora_rank`` on
    ``cfg.lora_target_modules`` (everything else frozen): continued pretraining that fits a CPU."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=int(cfg.continued_lora_rank or 0),
        lora_alpha=cfg.continued_lora_alpha,
        lora_dropout=0.0,
        target_modules=list(cfg.lora_target_modules),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def merged(model: torch.nn.Module) -> PreTrainedModel:
    """The plain model to publish: a LoRA (from :func:`with_lora`) merged into its weights."""
    from peft import PeftModel

    return model.merge_and_unload() if isinstance(model, PeftModel) else model  # type: ignore[return-value]


def count_parameters(model: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)
