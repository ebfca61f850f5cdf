"""Config composition: every preset composes; each mistake is one line naming the key. The same
mistakes met through a launched pipeline are in tests/e2e/test_config_cli.py."""

from __future__ import annotations

import pytest

from pipelines.entry import precheck
from tests.helpers import REPO


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["experiment=ci_tiny"],
        ["experiment=demo"],
        ["model=small"],
        ["model=smollm2_135m"],
        ["experiment=tiny"],
        ["model=gemma4_e4b", "model.name_or_path=/models/gemma", "train=gpu_fsdp"],
        ["model=pretrained", "model.name_or_path=/models/x", "train=gpu_ddp"],
        ["experiment=ci_tiny", "train.launcher=torchrun", "train.nproc=2"],
        ["--multirun", "train.seed=1,2"],
    ],
)
def test_presets_compose(overrides: list[str]) -> None:
    precheck(overrides)  # raises SystemExit on any problem


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("model.hiden_size=3", "model.hiden_size"),
        ("+train.foo=1", "train.foo"),
        ("train.max_steps=abc", "train.max_steps"),
        ("model=pretrained", "model.name_or_path"),
        ("corpus.name=???", "corpus.name"),
        ("train.launcher=mpi", "train.launcher"),
        ("model=tinyy", "available: gemma4_e4b, pretrained, small, smollm2_135m, tiny"),
        ("corpus.include=[nope]", "corpus.include: no work 'nope'"),
        ("corpus.works.homer_iliad.trait_affinity=[Eros]", "corpus.works.homer_iliad.trait_affinity"),
        ("train.warmup_steps=1000", "train.warmup_steps"),
    ],
)
def test_mistakes_fail_with_one_line_naming_the_key(override: str, expected: str, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        precheck([override])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ")
    assert expected in err


def test_library_never_imports_hydra() -> None:
    offenders = [
        p.name
        for p in (REPO / "nimmer_train").rglob("*.py")
        if "import hydra" in p.read_text() or "from hydra" in p.read_text()
    ]
    assert offenders == []
