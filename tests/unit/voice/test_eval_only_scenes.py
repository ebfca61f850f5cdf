"""The voice report speaks in more scenes than the two the adapters' training sets hold out
(issue 38): six eval-only scenes (data/scenes/voice_eval_only.yaml) that no training data has,
so its intervals resample eight scenes; the draw spreads the turns evenly over them."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import pytest

from nimmer_train.artifacts import REPO_ROOT
from nimmer_train.errors import NimmerError
from nimmer_train.runtime.voice_eval import Heldout, eval_only_scenes, eval_prompts, report_scenes
from nimmer_train.synth.synthesize import heldout_scenes
from tests.helpers.compose import config

FILE = REPO_ROOT / "data" / "scenes" / "voice_eval_only.yaml"


def test_eval_only_scenes_are_in_no_training_data() -> None:
    """Not in the composition every experiment trains on (names, situations, player lines), not in
    the seed set (the replay teacher's r1 and the classifier's lines), and no source file but the
    voice report's config names them (no stage can pick them up as data)."""
    names = {"demo": config("experiment=demo"), "tiny": config("experiment=tiny"), "ci": config()}
    scenes, source = eval_only_scenes(FILE, names["ci"].composition)
    assert len(scenes) == 6 and source.startswith("voice_eval_only.yaml sha256 ")
    for cfg in names.values():
        assert cfg.publish.voice_eval.eval_scenes == str(FILE)
        trained = cfg.composition.scenes
        for field in ("name", "situation", "player_utterance"):
            assert not {getattr(s, field) for s in scenes} & {getattr(s, field) for s in trained}
    seed = [
        json.loads(line)
        for line in (REPO_ROOT / "data/seed/teacher_replay_v1.jsonl").read_text().splitlines()
    ]
    assert not {s.name for s in scenes} & {row.get("scene") for row in seed}
    text = "\n".join(json.dumps(row) for row in seed).lower()
    assert not any(s.player_utterance.lower() in text for s in scenes)
    for folder in ("nimmer_train", "conf", "pipelines", "federated"):
        for path in (REPO_ROOT / folder).rglob("*"):
            if path.suffix in (".py", ".yaml") and "voice_eval_only" in path.read_text():
                assert path.relative_to(REPO_ROOT).as_posix() in (
                    "nimmer_train/config/schema.py",
                    "conf/publish/default.yaml",
                ), path
            if path.suffix in (".py", ".yaml"):
                assert not any(s.name in path.read_text() for s in scenes), path


def test_the_report_speaks_in_the_held_out_and_eval_only_scenes_never_a_trained_one() -> None:
    cfg = config()
    names = [s.name for s in cfg.composition.scenes]
    held = sorted(heldout_scenes(names, cfg.curation.validation_fraction))
    spoken, scenes, recorded = report_scenes(
        cfg.publish.voice_eval, cfg.composition, Heldout(tuple(held), "x")
    )
    assert len(scenes) == 8 and recorded["eval_only_scenes"] == scenes[2:]
    prompts = eval_prompts(cfg.registers, spoken, ["caste-preacher", "drunk-scavenger"], 16, 0, scenes)
    assert {p.scene for p in prompts} == set(scenes) and not {p.scene for p in prompts} & (
        set(names) - set(held)
    )
    per = Counter((p.register, p.scene) for p in prompts)
    assert set(per.values()) == {2}  # 16 turns over 8 scenes: two in each, for each register
    eight = eval_prompts(cfg.registers, spoken, ["caste-preacher"], 8, 0, scenes)
    assert len({p.scene for p in eight}) == 8  # the card's 8 turns: one per scene
    # no eval-only scenes configured: the held-out ones alone
    off = dataclasses.replace(cfg.publish.voice_eval, eval_scenes=None)
    assert report_scenes(off, cfg.composition, Heldout(tuple(held), "x"))[1] == held


def test_an_eval_only_scene_the_composition_has_or_a_bad_file_is_refused(tmp_path: Path) -> None:
    composition = config().composition
    clash = tmp_path / "clash.yaml"
    first = dataclasses.asdict(composition.scenes[0])
    clash.write_text(json.dumps({"scenes": [first]}))
    with pytest.raises(NimmerError, match=r"also in the composition 'v1_demo', whose scenes are trained on"):
        eval_only_scenes(clash, composition)
    reworded = tmp_path / "reworded.yaml"  # a new name on a trained scene's player line
    reworded.write_text(json.dumps({"scenes": [{**first, "name": "renamed"}]}))
    with pytest.raises(NimmerError, match="also in the composition"):
        eval_only_scenes(reworded, composition)
    lacking = tmp_path / "lacking.yaml"
    lacking.write_text("scenes:\n  - name: x\n    situation: y\n")
    with pytest.raises(
        NimmerError, match=r"lacking.yaml \(publish.voice_eval.eval_scenes\).*lacks player_utterance"
    ):
        eval_only_scenes(lacking, composition)
    with pytest.raises(NimmerError, match="no eval-only scenes at .*set the key to null"):
        eval_only_scenes(tmp_path / "missing.yaml", composition)
