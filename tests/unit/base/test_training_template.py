"""A pretrained ChatML tokenizer without TRL's generation markers (SmolLM2's) gets them for the
register LoRAs' assistant-only loss, rendering what the pipeline sends exactly as before; a
template that is neither is refused with the fix."""

from __future__ import annotations

import pytest

from nimmer_train.base.tokenizer import CHAT_TEMPLATE, train_bpe, training_template
from nimmer_train.errors import NimmerError

SMOLLM2 = (  # SmolLM2-135M-Instruct's template, as its GGUF carries it
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}"
)
TURN = [
    {"role": "system", "content": "You are the drunk scavenger."},
    {"role": "user", "content": "Which way to the water line?"},
    {"role": "assistant", "content": '{"utterance": "Left, past the drain."}'},
]


@pytest.fixture(scope="module")
def tokenizer():
    return train_bpe(["Which way to the water line? Left, past the drain."] * 20, 300, 256)


def test_a_chatml_template_without_markers_gets_them_and_renders_the_same(tokenizer) -> None:
    tokenizer.chat_template = SMOLLM2
    before = tokenizer.apply_chat_template(TURN, tokenize=False)
    tokenizer.chat_template = training_template(tokenizer)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.apply_chat_template(TURN, tokenize=False) == before
    out = tokenizer.apply_chat_template(TURN, return_dict=True, return_assistant_tokens_mask=True)
    mask, ids = out["assistant_masks"], out["input_ids"]
    reply = tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert reply == '{"utterance": "Left, past the drain."}<|im_end|>'


def test_a_template_with_markers_is_kept_and_one_that_is_neither_is_refused(tokenizer) -> None:
    tokenizer.chat_template = CHAT_TEMPLATE + "{# a site's own variant #}"  # has the markers: kept
    assert training_template(tokenizer) == tokenizer.chat_template
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\\n{% endfor %}"
    with pytest.raises(NimmerError, match="generation %}} markers|generation %} markers"):
        training_template(tokenizer)


def test_the_register_lora_encoding_labels_only_the_reply_under_a_chatml_template(tokenizer) -> None:
    from nimmer_train.loras.train import encode

    tokenizer.chat_template = SMOLLM2  # as converted from the GGUF: no markers
    enc = encode(tokenizer, TURN, 256)
    labelled = tokenizer.decode([t for t in enc["labels"] if t != -100])
    assert labelled == '{"utterance": "Left, past the drain."}<|im_end|>'
    assert tokenizer.chat_template == SMOLLM2  # the serving template itself is left as it is
