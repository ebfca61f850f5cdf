"""lora.top_layers puts the register LoRA on the top N decoder layers only (issue 38's speed
option): below the lowest adapted layer nothing needs a gradient, so the backward pass stops
there; a count the base cannot hold fails with one line naming the key."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from nimmer_train.errors import NimmerError
from nimmer_train.loras.train import top_layers


def _tiny(layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def test_the_adapter_sits_on_the_top_layers_and_the_backward_stops_below_them() -> None:
    model = _tiny()
    assert top_layers(model, None) is None
    assert top_layers(model, 2) == [2, 3]
    peft = get_peft_model(
        model,
        LoraConfig(r=4, target_modules=["q_proj", "v_proj"], layers_to_transform=top_layers(model, 2)),
    )
    adapted = {n.split(".layers.")[1].split(".")[0] for n, p in peft.named_parameters() if p.requires_grad}
    assert adapted == {"2", "3"}
    seen: list[bool] = []
    hook = peft.base_model.model.model.layers[1].register_forward_hook(
        lambda m, i, o: seen.append((o[0] if isinstance(o, tuple) else o).requires_grad)
    )
    peft(input_ids=torch.randint(0, 64, (1, 8)), labels=torch.randint(0, 64, (1, 8))).loss.backward()
    hook.remove()
    assert seen == [False]  # no graph below layer 2: the backward pass ends there


@pytest.mark.parametrize("count", [0, 5])
def test_a_count_the_base_cannot_hold_is_one_line(count: int) -> None:
    with pytest.raises(NimmerError, match=rf"lora.top_layers={count}: the base has 4 decoder layers"):
        top_layers(_tiny(), count)
