"""The engine's growing KV cache gives the logits transformers' own DynamicCache gives: prefill,
decode steps past the buffer's room, rows selected out, and a cache assigned from outside; a
ragged step's rows join in place where there is room and leaving rows move only those below."""

from __future__ import annotations

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from nimmer_train.runtime.decode_attention import use_decode_attention
from nimmer_train.runtime.kv_cache import ROOM, GrowingLayer, Ragged, Segment, growing_cache


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config).eval()


def _decode(model: LlamaForCausalLM, cache: DynamicCache, steps: int, select_at: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 97, (3, 9 + ROOM + 7), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[2, :4] = 0  # a left-padded row
    out = [model(input_ids=ids[:, :9], attention_mask=mask, cache=cache, use_cache=True).logits[:, -1]]
    # then more of the prompt than the buffer has room for, in one forward (a cached prefix's rest)
    mask = torch.cat([mask, mask.new_ones(3, ROOM + 7)], dim=1)
    positions = (mask.cumsum(dim=1) - 1)[:, 9:]
    out.append(
        model(
            input_ids=ids[:, 9:], attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        ).logits[:, -1]
    )
    for step in range(steps):
        token = out[-1].argmax(-1, keepdim=True)
        if step == select_at:  # a row leaves the batch, as the engine's sweep does
            keep = torch.tensor([0, 2])
            for layer in cache.layers:
                layer.keys = layer.keys.index_select(0, keep)
                layer.values = layer.values.index_select(0, keep)
            mask, token = mask.index_select(0, keep), token.index_select(0, keep)
        positions = mask.sum(dim=1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        logits = model(
            input_ids=token, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
        ).logits[:, -1]
        out.append(logits)
    return out


def test_growing_cache_decodes_as_dynamic_cache_does() -> None:
    model = _model()
    steps = ROOM + 20  # past the first buffer's room: it grows once
    with torch.inference_mode():
        want = _decode(model, DynamicCache(config=model.config), steps, select_at=30)
        cache = growing_cache(model.config)
        got = _decode(model, cache, steps, select_at=30)
        assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert all(isinstance(layer, GrowingLayer) for layer in cache.layers)
    assert cache.get_seq_length() == 9 + ROOM + 7 + steps
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b)
    layer = cache.layers[0]
    assert layer._k is not None and layer._k.buf.shape[2] > layer.keys.shape[2]  # room to grow in place


def test_a_layer_assigned_from_outside_keeps_what_it_was_given() -> None:
    layer = GrowingLayer()
    keys, values = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    layer.keys, layer.values = keys, values
    layer.is_initialized = True
    more = torch.randn(2, 2, 1, 4)
    k, v = layer.update(more, more)
    torch.testing.assert_close(k, torch.cat([keys, more], dim=2))
    torch.testing.assert_close(v, torch.cat([values, more], dim=2))
    keys[0, 0, 0, 0] = 99.0  # the layer holds its own copy
    assert layer.keys[0, 0, 0, 0] != 99.0
    layer.keys = layer.values = None
    assert layer.keys is None and layer.values is None


def test_keys_and_values_assigned_one_after_the_other_keep_their_own_lengths() -> None:
    # the engine's sweep trims padding and its merge widens the batch: keys first, then values
    # computed from the values as they were
    layer = GrowingLayer()
    keys, values = torch.randn(2, 2, 5, 4), torch.randn(2, 2, 5, 4)
    layer.keys, layer.values = keys, values
    layer.is_initialized = True
    layer.keys = layer.keys[:, :, 2:]
    layer.values = layer.values[:, :, 2:]
    torch.testing.assert_close(layer.values, values[:, :, 2:])
    wider = torch.randn(2, 2, ROOM + 9, 4)
    layer.keys = torch.cat([layer.keys, wider], dim=2)
    layer.values = torch.cat([layer.values, wider], dim=2)
    torch.testing.assert_close(layer.keys, torch.cat([keys[:, :, 2:], wider], dim=2))
    torch.testing.assert_close(layer.values, torch.cat([values[:, :, 2:], wider], dim=2))
    layer.keys, layer.values = layer.keys[:, :, 99:], layer.values[:, :, 99:]  # nothing left
    assert layer.keys.shape[2] == layer.values.shape[2] == 0 and layer.get_seq_length() == 0


def test_join_stacks_two_batches_left_padded_in_one_buffer_with_room() -> None:
    top, bottom = GrowingLayer(), GrowingLayer()
    a, b = torch.randn(2, 2, 5, 4), torch.randn(1, 2, 8, 4)
    top.keys, top.values, bottom.keys, bottom.values = a, a + 1, b, b + 1
    width = 9
    top.join(bottom, width)  # what the engine's merge did with torch.cat of left-padded sides

    def padded(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x.new_zeros(x.shape[0], x.shape[1], width - x.shape[2], x.shape[3]), x], dim=2)

    torch.testing.assert_close(top.keys, torch.cat([padded(a), padded(b)]), rtol=0, atol=0)
    torch.testing.assert_close(top.values, torch.cat([padded(a + 1), padded(b + 1)]), rtol=0, atol=0)
    assert top._k is not None and top._k.buf.shape[2] == width + ROOM  # room to decode in place
    more = torch.randn(3, 2, 1, 4)
    top.is_initialized = True
    k, _ = top.update(more, more)
    torch.testing.assert_close(k[:, :, -1:], more)


def test_a_cache_can_store_its_keys_and_values_in_float32_for_a_bfloat16_model() -> None:
    model = _model().to(torch.bfloat16)
    use_decode_attention(model)  # transformers' SDPA wants keys in the query's dtype; this one upcasts
    cache = growing_cache(model.config, torch.float32)
    ids = torch.randint(0, 97, (2, 6))
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True)
        layer = cache.layers[0]
        assert layer.keys.dtype == layer.values.dtype == torch.float32
        step = torch.randn(2, 2, 1, 8, dtype=torch.bfloat16)
        layer.update(step, step)
        assert layer.keys.dtype == torch.float32 and layer.keys.shape[2] == 7


def test_ragged_joins_write_in_place_where_there_is_room_and_leaving_rows_move_only_those_below() -> None:
    layer = GrowingLayer()
    running = torch.randn(3, 2, 5, 4)  # a batch of 3 rows, 5 positions, assigned from outside
    layer.keys, layer.values = running, -running
    layer.is_initialized = True

    def step(width: int, seg: Segment) -> tuple[torch.Tensor, torch.Tensor]:
        """A ragged step's writes: each running row's next position, then the segment's tokens."""
        rows = seg.row
        new = torch.randn(1, 2, rows + seg.tokens, 4)
        layer.ragged = Ragged(rows, (seg,), width, None)
        keys, values = layer.update(new, -new)
        layer.ragged = None
        torch.testing.assert_close(values, -keys, rtol=0, atol=0)
        return new[0].transpose(0, 1), keys  # [tokens, heads, dim]

    # two choices of a 5-token prompt join, 2 positions cached: no room for rows, new buffers
    prefix = torch.randn(1, 2, 2, 4)
    layer.extend([(prefix, -prefix, 2, 6 - 3)], 6, own_end=5)
    new, keys = step(6, Segment(3, 2, 3, 5))
    want = torch.zeros(5, 2, 6, 4)
    want[:3, :, :5], want[:3, :, 5] = running, new[:3]
    want[3:, :, 1:3], want[3:, :, 3:] = prefix, new[3:].transpose(0, 1)
    torch.testing.assert_close(keys, want, rtol=0, atol=0)
    buffer = layer._k.buf if layer._k is not None else None
    assert buffer is not None and buffer.shape[0] > 5  # room for more rows

    # a 4-token prompt, nothing cached, joins with room: written in place, no running row moved
    layer.extend([(None, None, 1, 7 - 4)], 7, own_end=6)
    new, keys = step(7, Segment(5, 1, 4, 4))
    assert layer._k is not None and layer._k.buf is buffer
    want = torch.cat([want, torch.zeros(5, 2, 1, 4)], dim=2)
    want[:, :, 6] = new[:5]
    want = torch.cat([want, torch.zeros(1, 2, 7, 4)])
    want[5, :, 3:] = new[5:].transpose(0, 1)
    torch.testing.assert_close(keys, want, rtol=0, atol=0)

    # the first rows leave and row 4; the first column is padding for the two left: trimmed,
    # they move up (over positions 1 to 6 only), nothing else is copied
    layer.keep_rows([3, 5], 1)
    want = want[[3, 5], :, 1:]
    torch.testing.assert_close(layer.keys, want, rtol=0, atol=0)
    torch.testing.assert_close(layer.values, -want, rtol=0, atol=0)
    assert layer._k is not None and layer._k.buf is buffer and buffer[0, :, 0].any()  # stale there

    # a prompt longer than the batch: the window widens to the left over the trimmed column,
    # which holds stale positions: zeros now
    layer.extend([(None, None, 1, 8 - 8)], 8, own_end=7)
    new, keys = step(8, Segment(2, 1, 8, 8))
    assert layer._k is not None and layer._k.buf is buffer
    assert not keys[:2, :, 0].any()
    torch.testing.assert_close(keys[:2, :, 1:7], want, rtol=0, atol=0)
    torch.testing.assert_close(keys[:2, :, 7], new[:2], rtol=0, atol=0)
    torch.testing.assert_close(keys[2], new[2:].transpose(0, 1), rtol=0, atol=0)
