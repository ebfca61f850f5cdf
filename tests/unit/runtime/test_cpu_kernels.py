"""The serving model's CPU kernels give the logits transformers' own path gives: linear layers
through prepacked oneDNN weights (runtime/packed_linear.py) and the decode attention
(runtime/decode_attention.py), on a left-padded GQA batch, prefill then decode steps."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from nimmer_train.runtime.decode_attention import NAME, use_decode_attention
from nimmer_train.runtime.kv_cache import growing_cache
from nimmer_train.runtime.packed_linear import pack_linears, packing_available

needs_onednn = pytest.mark.skipif(not packing_available(), reason="this torch build has no oneDNN")


def _model(dtype: torch.dtype = torch.float32, attention: str | None = None) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query: two query heads per key/value head
        max_position_embeddings=256,
    )
    if attention is not None:
        config._attn_implementation = attention
    return LlamaForCausalLM(config).eval().to(dtype)


def _logits(model: LlamaForCausalLM, steps: int = 6) -> torch.Tensor:
    """A left-padded batch of 3: the prefill's last logits, then ``steps`` greedy decode steps'."""
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (3, 12), generator=gen)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0
    cache = growing_cache(model.config)
    with torch.inference_mode():
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = [model(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache).logits[:, -1]]
        for _ in range(steps):
            token = out[-1].argmax(-1, keepdim=True)
            positions = mask.sum(dim=1, keepdim=True)
            mask = torch.cat([mask, mask.new_ones(3, 1)], dim=1)
            logits = model(input_ids=token, attention_mask=mask, position_ids=positions, cache=cache).logits
            out.append(logits[:, -1])
    return torch.stack(out).float()


@needs_onednn
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_linears_give_the_plain_logits(dtype: torch.dtype) -> None:
    want = _logits(_model(dtype))
    model = _model(dtype)
    assert pack_linears(model) == 2 * 7 + 1  # q k v o gate up down per layer, and the output layer
    got = _logits(model)
    tolerance = 1e-4 if dtype == torch.float32 else 0.05  # bfloat16 rounds differently per kernel
    assert (want - got).abs().max() < tolerance
    assert (want[0, 0] - want[0, 1]).abs().max() > 10 * tolerance  # rows differ: the check can fail


@needs_onednn
def test_a_packed_linear_follows_its_weight_and_keeps_autograd() -> None:
    layer = torch.nn.Linear(16, 8)
    pack_linears(layer)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    with torch.no_grad():
        layer.weight.mul_(2.0)  # written in place: its version counter moves, the next forward repacks
    with torch.inference_mode():
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    layer.to(torch.bfloat16)  # another dtype: repacked for it
    with torch.inference_mode():
        want = torch.nn.functional.linear(x.bfloat16(), layer.weight, layer.bias).float()
        assert (layer(x.bfloat16()).float() - want).abs().max() < 0.05
    layer.to(torch.float32)
    y = layer(x.requires_grad_())  # gradients on: the plain kernel (the packed one has no backward)
    y.sum().backward()
    assert x.grad is not None and torch.allclose(x.grad, layer.weight.sum(0).expand(3, -1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_attention_gives_sdpas_logits(dtype: torch.dtype) -> None:
    reference = _logits(_model(torch.float32))  # transformers' SDPA in float32
    model = _model(dtype)
    use_decode_attention(model)
    assert model.config._attn_implementation == NAME
    got = _logits(model)
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert (reference - got).abs().max() < tolerance
    other = _model(dtype)  # another model in the process keeps transformers' attention
    assert other.config._attn_implementation != NAME


@needs_onednn
def test_a_packed_model_deep_copies_and_a_data_write_needs_a_repack() -> None:
    import copy

    model = _model()
    pack_linears(model)
    twin = copy.deepcopy(model)  # PEFT's modules_to_save deep-copies a module: the packs stay behind
    torch.testing.assert_close(_logits(twin), _logits(model))
    layer = model.model.layers[0].mlp.down_proj
    before = _logits(model)
    with torch.no_grad():
        layer.weight.data.mul_(2.0)  # through .data (PEFT's merge_adapter): no version counter moves
    assert pack_linears(model) == 15  # so the caller packs again, as the module docstring says
    after = _logits(model)
    assert (after - before).abs().max() > 1e-3
    layer.forward = torch.nn.Linear.forward.__get__(layer)  # the plain path agrees
    torch.testing.assert_close(_logits(model), after, atol=1e-4, rtol=0)


@needs_onednn
def test_a_layer_made_under_inference_mode_packs() -> None:
    with torch.inference_mode():
        layer = torch.nn.Linear(16, 8)  # inference tensors have no version counter
        assert pack_linears(layer) == 1
        x = torch.randn(2, 16)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_a_model_on_eager_attention_keeps_it() -> None:
    model = _model(attention="eager")  # as Gemma 2 (softcap) or a model without SDPA support
    assert not use_decode_attention(model)
    assert model.config._attn_implementation == "eager"
    assert use_decode_attention(_model())  # an SDPA model switches
