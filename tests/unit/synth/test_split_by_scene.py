"""The LoRA held-out set (issue 22, item 4): split by scene, so that no held-out conversation
shares a scene with training; the held-out scenes' replies also before curation (r0), so that an
evaluation need not rest on replies chosen for being separable; every split counted per register."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
from datasets import load_from_disk

from nimmer_train.synth.synthesize import VALIDATION, VALIDATION_UNFILTERED, heldout_scenes
from nimmer_train.voice.prompt_dsl import render_reply
from tests.helpers.compose import config
from tests.helpers.outputs import synth_dir


def test_heldout_scenes_are_a_stable_share_never_all() -> None:
    scenes = [f"scene-{i}" for i in range(6)]
    two = heldout_scenes(scenes, 0.2)
    assert len(two) == 2 and two == heldout_scenes(list(reversed(scenes)), 0.2)  # ceil(1.2), any order
    assert len(heldout_scenes(scenes[:4], 0.2)) == 1 and heldout_scenes(scenes[:1], 0.5) == set()
    assert len(heldout_scenes(scenes, 0.99)) == 5 and heldout_scenes(scenes, 0.0) == set()


def test_the_demo_composition_holds_two_whole_scenes_out() -> None:
    cfg = config("experiment=ci_tiny")
    names = [scene.name for scene in cfg.composition.scenes]
    held = heldout_scenes(names, cfg.curation.validation_fraction)
    assert len(names) == 6 and len(held) == 2


@pytest.mark.slow
def test_heldout_scenes_are_disjoint_from_training_scenes(tiny_run: Path) -> None:
    folder = synth_dir(tiny_run)
    r1 = load_from_disk(str(folder / "r1"))
    stats = json.loads((folder / "stats.json").read_text())
    train = {row["scene"] for row in r1["train"]}
    held = {row["scene"] for row in r1[VALIDATION]}
    assert held == set(stats["heldout_scenes"]) and len(held) == 2
    assert not train & held and train | held == {s.name for s in config().composition.scenes}
    per_register = Counter(row["register"] for row in r1[VALIDATION])
    assert len(per_register) == 5 and min(per_register.values()) >= 20  # n per register, all registers
    assert stats["splits"] == {name: len(r1[name]) for name in r1}


@pytest.mark.slow
def test_unfiltered_split_holds_every_schema_valid_reply_of_the_heldout_scenes(tiny_run: Path) -> None:
    folder = synth_dir(tiny_run)
    r0 = load_from_disk(str(folder / "r0"))
    r1 = load_from_disk(str(folder / "r1"))
    held = set(json.loads((folder / "stats.json").read_text())["heldout_scenes"])
    no_reply = ("timeout", "backend_error", "empty", "not_json", "schema")
    valid = [r for r in r0 if r["scene"] in held and r["reason"] not in no_reply]
    unfiltered = r1[VALIDATION_UNFILTERED]
    assert sorted(r["request_key"] for r in unfiltered) == sorted(r["request_key"] for r in valid)
    assert {r["status"] for r in unfiltered} == {"kept", "rejected"}  # curation's rejects are in it
    assert Counter(r["register"] for r in unfiltered) == Counter(r["register"] for r in valid)
    kept = {r["request_key"] for r in r1[VALIDATION]}
    assert kept == {r["request_key"] for r in unfiltered if r["status"] == "kept"}
    for row in unfiltered.select(range(10)):
        reply = json.loads(row["messages"][-1]["content"])
        assert row["messages"][-1]["content"] == render_reply(reply)  # the training format
