"""The hf_local teacher stops at the chat template's end-of-turn token (issue 22, item 7), with the
repetition penalty on generated tokens only, like every in-process decoder."""

from __future__ import annotations

from pathlib import Path

import pytest

from nimmer_train.config import TeacherConfig
from nimmer_train.synth.teacher import make_teacher
from nimmer_train.voice.composition import expand
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.compose import composition
from tests.helpers.outputs import base_dir

pytestmark = pytest.mark.slow


def test_hf_local_stops_at_the_end_of_turn_token(tiny_run: Path) -> None:
    spec = composition("composition.registers=[drunk-scavenger]", "composition.per_register=3")
    batch = expand(spec, load_catalogue())
    cfg = TeacherConfig(  # json_mode off: the schema mask would not allow an empty turn
        backend="hf_local",
        model_path=str(base_dir(tiny_run)),
        max_new_tokens=20,
        batch_size=3,
        json_mode=False,
    )
    teacher = make_teacher(cfg)
    im_end = teacher.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def hook(module, args, output):  # noqa: ANN001, ANN202
        output.logits[..., im_end] = 1e4  # the teacher ends its turn at once
        return output

    handle = teacher.lm.register_forward_hook(hook)
    try:
        replies = teacher.generate(batch)
    finally:
        handle.remove()
    assert [(r.content, r.completion_tokens) for r in replies] == [("", 1)] * 3  # not 20 tokens each
