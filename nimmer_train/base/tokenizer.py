"""Tokenizers for the base: a byte-level BPE trained on the corpus, or a pretrained one reused.

The trained tokenizer carries the special tokens and the ChatML-style chat template that the
prompt DSL and TRL's conversational format need. The template marks assistant turns with
``{% generation %}`` so that ``return_assistant_tokens_mask=True`` (TRL's assistant-only loss)
works.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
PAD = "<|pad|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS, PAD, IM_START, IM_END]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def train_bpe(texts: Iterable[str], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style pre-tokenisation) on ``texts``."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_batches(texts), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS,
        bos_token=EOS,
        pad_token=PAD,
        unk_token=None,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=model_max_length,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _batches(texts: Iterable[str], size: int = 256) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in texts:
        batch.append(text)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


_PROBES = (  # what the pipeline renders: a system prompt, turns, replies, the generation prompt
    [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
    ],
    [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "U"},
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "V"},
        {"role": "assistant", "content": "B"},
    ],
)


def training_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """``tokenizer``'s chat template as TRL's assistant-only loss needs it (``{% generation %}``
    around assistant content). A template that has the markers is returned as it is; a ChatML one
    without them (SmolLM2's, Qwen's) is replaced by :data:`CHAT_TEMPLATE` when the two render
    every system-led conversation identically (what the prompt DSL sends; a conversation without
    a system message then gets no default one). Anything else: a NimmerError naming the fix."""
    from nimmer_train.errors import NimmerError

    template = tokenizer.chat_template or ""
    if "{% generation %}" in template or "{%- generation %}" in template:
        return template
    vocab = tokenizer.get_vocab()
    if IM_START in vocab and IM_END in vocab:
        same = all(
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=g)
            == tokenizer.apply_chat_template(
                c, tokenize=False, add_generation_prompt=g, chat_template=CHAT_TEMPLATE
            )
            for c in _PROBES
            for g in (False, True)
            if not (g and c[-1]["role"] == "assistant")
        )
        if same:
            return CHAT_TEMPLATE
    raise NimmerError(
        f"{tokenizer.name_or_path}: its chat template has no {{% generation %}} markers around the "
        "assistant's content, which the register LoRAs' assistant-only loss needs, and it is not "
        "ChatML; add the markers to tokenizer_config.json's chat_template (see CHAT_TEMPLATE in "
        "nimmer_train/base/tokenizer.py)"
    )


def load_pretrained(name_or_path: str) -> PreTrainedTokenizerBase:
    """A pretrained model's tokenizer; adds a pad token (= eos) where it has none."""
    tok = AutoTokenizer.from_pretrained(name_or_path)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
