"""The voice report (nimmer_train/voice/quality.py, measured through Ring A by
nimmer_train/runtime/voice_eval.py): its figures on hand-made lines, and the report in a published
version's model card and beside the speak stage's turns."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from nimmer_train.artifacts import README, REPO_ROOT
from nimmer_train.runtime.voice_eval import (
    Heldout,
    eval_prompts,
    heldout_of_adapters,
    heldout_of_config,
    recorded_heldout,
    recorded_settings,
)
from nimmer_train.voice.quality import (
    GOALS,
    NONE,
    GeneratedTurn,
    SeedLine,
    copies,
    copy_grams,
    distinct_n,
    english_rate,
    fit_classifier,
    heldout_summary,
    is_english,
    mean_words,
    parse_reply,
    report_lines,
    score,
    seed_classifier,
    seed_lines,
)
from nimmer_train.voice.registers import load_catalogue

SEED_SET = REPO_ROOT / "data" / "seed" / "teacher_replay_v1.jsonl"
CATALOGUE = load_catalogue()


def test_english_rate_tells_english_from_gibberish() -> None:
    assert english_rate(["The water gate closes at the second bell, so hurry home before dark."]) == 1.0
    assert english_rate(["Zzkr vlorn qwpx blenthor gragh, skizzat thrumbek!"]) == 0.0
    assert english_rate(["the water zzkr vlorn"]) == 0.5
    assert english_rate(["I saw a t s w"]) == 0.5  # a lone letter is a word only as a, I, O
    assert english_rate(["", "42 , ;"]) == 0.0 and english_rate([]) is None  # a reply without a word: 0


def turn(register: str, utterance: str) -> GeneratedTurn:
    return GeneratedTurn(register, json.dumps({"utterance": utterance}))


def test_english_rate_is_per_reply_so_one_long_reply_does_not_carry_fragments() -> None:
    """15 of 16 replies are one-letter fragments (as the tiny demo's "t, "): one long English reply
    does not lift the rate (pooled over tokens it was 0.93); the overall is the mean over registers."""
    long = " ".join(["the old man walked to the gate and said nothing more"] * 20)
    turns = [turn("drunk-scavenger", long)] + [turn("drunk-scavenger", "t, ")] * 7
    turns += [turn("hivemind-broadcast", "s")] * 8
    report = score(turns, seed_classifier(SEED_SET))
    rows = {r.register: r for r in report.registers}
    assert rows["drunk-scavenger"].english_rate == 1 / 8 and rows["hivemind-broadcast"].english_rate == 0.0
    assert report.overall.english_rate == 1 / 16 and report.overall.speaks == 1 / 16


def test_a_reply_without_a_word_scores_zero_english_and_does_not_speak() -> None:
    """{"utterance": ", "} (the issue's own broken turn) validates against the schema; it counts as
    0 English and as not speaking instead of dropping out."""
    row = score([turn("caste-preacher", ", ")] * 8, seed_classifier(SEED_SET)).registers[0]
    assert row.schema_valid == 1.0 and row.english_rate == 0.0 and row.speaks == 0.0
    assert row.register_accuracy == 0.0 and row.predicted == {NONE: 8} and row.mean_words == 0.0


def test_short_fragments_and_possessives() -> None:
    """2- and 3-letter tokens need a high Zipf (fragments sit at 3-4.8); a trailing 's is dropped."""
    for word in ("the", "and", "was", "old", "her", "to", "of", "oh", "warden's", "warden’s"):
        assert is_english(word), word
    for fragment in ("ts", "er", "nt", "ou", "th", "bal", "ing", "t", "s"):
        assert not is_english(fragment), fragment
    assert english_rate(["ts er nt ou th ing ed"]) == 0.0
    # the hand-written seed set stays English (0.982; names and archaic forms are what it loses)
    assert english_rate([x.utterance for x in seed_lines(SEED_SET)]) > 0.97


def test_distinct_2_and_mean_words() -> None:
    repeated = ["the gate is shut"] * 4
    varied = ["the gate is shut", "bring the lamp here", "wardens walk at dusk", "no bread tonight"]
    assert distinct_n(repeated) == 0.25  # 3 distinct bigrams of 12
    assert distinct_n(varied) == 1.0  # 11 of 11
    assert distinct_n(["one"]) is None
    assert mean_words(varied) == 3.75 and mean_words([]) is None


def test_schema_valid_rate_and_the_report() -> None:
    assert parse_reply('{"utterance": "Hush."}') == {"utterance": "Hush."}
    for bad in ('{"utterance": "Hush."', '{"utterance": ""}', '{"utterance": "x", "mood": "y"}', None):
        assert parse_reply(bad) is None
    classifier = fit_classifier(
        [SeedLine("a", "s1", "Heh, mate, pfah, rotgut!"), SeedLine("b", "s1", "Directive: comply. Logged.")]
        * 3
    )
    turns = [
        GeneratedTurn("a", '{"utterance": "Heh, mate, the rotgut is free."}'),
        GeneratedTurn("a", '{"utterance": "Heh'),  # cut off: not JSON
        GeneratedTurn("b", '{"utterance": "Directive four: comply. Your presence is logged."}'),
        GeneratedTurn("b", None, error="generation failed"),
    ]
    report = score(turns, classifier, "v9", {"turns_per_register": 2, "max_new_tokens": 16, "seed": 0})
    rows = {r.register: r for r in report.registers}
    assert rows["a"].schema_valid == rows["b"].schema_valid == report.overall.schema_valid == 0.5
    # an invalid reply is a miss: every per-reply figure is over all turns
    assert rows["a"].register_accuracy == report.overall.register_accuracy == 0.5 and report.chance == 0.5
    assert rows["a"].predicted == {"a": 1, "invalid": 1} and rows["a"].valid == 1
    assert classifier.cv_accuracy is None and classifier.threshold == 0.0  # one scene: no fold
    assert rows["a"].samples == ["Heh, mate, the rotgut is free."]
    metrics = report.metrics()  # voice.<vN>.<register or all>.<figure>, as publish and speak log them
    assert metrics["voice.v9.all.schema_valid"] == 0.5 and metrics["voice.v9.a.register_accuracy"] == 0.5
    text = "\n".join(report.lines())
    for goal in GOALS.values():
        assert f"goal >= {goal:.2f}" in text
    assert "labelled [a]: a 1, invalid 1" in text and "mean over registers" in text
    assert json.loads(json.dumps(report.summary()))["overall"]["turns"] == 4


def test_one_valid_reply_in_forty_does_not_meet_the_register_goal() -> None:
    """The register accuracy is over all turns (invalid replies are misses), not the valid ones;
    a register without a valid reply is shown as such."""
    classifier = seed_classifier(SEED_SET)
    line = next(
        e
        for e in CATALOGUE.get("drunk-scavenger").exemplars
        if classifier.label([e]) == ["drunk-scavenger"] and not copies(e, classifier.seed_grams)
    )
    turns = [turn("drunk-scavenger", line)] + [GeneratedTurn("drunk-scavenger", '{"utterance": "Heh')] * 39
    turns += [GeneratedTurn("caste-preacher", None, error="out of memory")] * 4
    report = score(turns, classifier)
    rows = {r.register: r for r in report.registers}
    assert rows["drunk-scavenger"].schema_valid == rows["drunk-scavenger"].register_accuracy == 1 / 40
    assert report.overall.register_accuracy == 1 / 80  # the mean over the two registers
    text = "\n".join(report.lines())
    assert "(no valid reply)" in text
    assert "[FAIL] register accuracy (all registers): 0.01 (goal >= 0.80)" in text
    assert "[FAIL] register accuracy (drunk-scavenger): 0.03 (goal >= 0.60)" in text


def test_garbage_is_not_labelled_as_one_register() -> None:
    """Fragments and punctuation used to fall into one register (drunk-scavenger 0.875 on garbage):
    the classifier abstains on replies under 3 words and on low confidence."""
    classifier = seed_classifier(SEED_SET)
    garbage = [", ", "t, ", "s", "m, ", "bal", "!!!!", "and", "fle, "]
    turns = [turn(name, g) for name in CATALOGUE.names for g in garbage]
    turns += [turn(name, "Zzkr vlorn qwpx blenthor gragh") for name in CATALOGUE.names]
    report = score(turns, classifier)
    assert all(r.register_accuracy == 0.0 and r.predicted == {NONE: 9} for r in report.registers)
    assert report.overall.abstain_rate == 1.0
    # calibrated on the seed set's cross-validation: real lines rarely abstain
    assert classifier.cv_abstain is not None and classifier.cv_abstain <= 0.03
    assert 0.2 < classifier.threshold < 0.6 and "abstains" in report.classifier


def test_verbatim_training_lines_are_copies_not_a_voice() -> None:
    """A LoRA that answers every held-out prompt with a line it was trained on (the replay teacher
    makes the seed lines of the training scenes its r1 set) used to meet every goal; copies are
    reported and count as register misses."""
    from nimmer_train.synth.synthesize import heldout_scenes

    lines = seed_lines(SEED_SET)
    held = heldout_scenes(sorted({x.scene for x in lines}), 0.2)
    trained = [x for x in lines if x.scene not in held]
    by = {name: [x for x in trained if x.register == name][:8] for name in CATALOGUE.names}
    turns = [turn(name, x.utterance) for name, xs in by.items() for x in xs]
    report = score(turns, seed_classifier(SEED_SET))
    assert report.overall.copy_rate == 1.0 and report.overall.register_accuracy == 0.0
    assert not all(getattr(report.overall, k) >= v for k, v in GOALS.items())
    assert "copied 1.00 (copies count as misses)" in "\n".join(report.lines())
    # what counts as a copy: 8 consecutive words of a line, or a whole 5-7-word run of one
    grams = copy_grams(["The water gate closes at the second bell tonight, so hurry home."])
    assert copies("Aye, the water gate closes at the second bell tonight, friend.", grams)
    assert copies("closes at the second bell", grams)
    assert not copies("the second bell tonight", grams)  # 4 words
    assert not copies("The water gate closes at the third bell tonight.", grams)


def test_the_eval_scenes_are_the_ones_the_adapters_held_out(tmp_path: Path) -> None:
    """Held-out scenes come from the adapters' training sets (metadata -> synth stats.json), not
    from the current config's validation_fraction (a run under 0.4 measured on scenes the
    adapters trained on); the config is the fallback, and the report says which."""
    from nimmer_train.synth.synthesize import heldout_scenes
    from tests.helpers.compose import config

    cfg = config("curation.validation_fraction=0.4")
    names = [s.name for s in cfg.composition.scenes]
    trained_held_out = sorted(heldout_scenes(names, 0.2))
    artifacts = tmp_path / "artifacts"
    stats = artifacts / "synth" / f"{cfg.composition.name}-{'a' * 12}" / "stats.json"
    stats.parent.mkdir(parents=True)
    stats.write_text(json.dumps({"heldout_scenes": trained_held_out}))
    adapters = []
    for name in ("caste-preacher", "drunk-scavenger"):
        (tmp_path / name).mkdir()
        meta = {"register": name, "datasets": {"synth": "a" * 64, "corpus": "0" * 64}}
        (tmp_path / name / "nimmer_adapter.json").write_text(json.dumps(meta))
        adapters.append(tmp_path / name)
    heldout = heldout_of_adapters(adapters, artifacts)
    assert (
        heldout is not None and list(heldout.scenes) == trained_held_out and "aaaaaaaaaaaa" in heldout.source
    )
    prompts = eval_prompts(cfg.registers, cfg.composition, ["caste-preacher"], 8, 0, heldout.scenes)
    assert {p.scene for p in prompts} <= set(trained_held_out)
    # no record (the synth folder is gone): the config's fraction, said so
    assert heldout_of_adapters(adapters, tmp_path / "elsewhere") is None
    fallback = heldout_of_config(cfg.composition, cfg.curation.validation_fraction)
    assert len(fallback.scenes) > len(trained_held_out) and "no record" in fallback.source
    # a published version records them (and the settings) in its voice report: speak reads them there
    recorded = {
        "voice_report": {
            "settings": {
                "heldout_scenes": trained_held_out,
                "heldout_source": "x",
                "turns_per_register": 5,
                "max_new_tokens": 40,
                "seed": 3,
            }
        }
    }
    assert recorded_heldout(recorded) == Heldout(tuple(trained_held_out), "recorded at publish: x")
    again = recorded_settings(cfg.publish.voice_eval, recorded)
    assert (again.turns_per_register, again.max_new_tokens, again.seed) == (5, 40, 3)
    assert (
        recorded_heldout({}) is None
        and recorded_settings(cfg.publish.voice_eval, {}) == cfg.publish.voice_eval
    )


def test_the_card_shows_the_confusion_copies_and_a_merged_register() -> None:
    from nimmer_train.publish.card import _voice_lines

    turns = [turn("drunk-scavenger", "Heh, mate, pfah, the rotgut's free tonight, so drink up.")] * 2
    turns += [GeneratedTurn("caste-preacher", '{"utterance": "Heh')] * 2
    settings = {
        "turns_per_register": 2,
        "max_new_tokens": 16,
        "seed": 0,
        "adapters": {"caste-preacher": None, "drunk-scavenger": "drunk-scavenger"},
        "merged_register": "caste-preacher",
        "scenes": ["fever-medicine"],
        "heldout_scenes": ["fever-medicine"],
        "heldout_source": "held out of the adapters' training sets",
    }
    summary = score(turns, seed_classifier(SEED_SET), "v2", settings).summary()
    card = "\n".join(_voice_lines(summary))
    assert "the `caste-preacher` register, merged into the weights, with the weights alone" in card
    assert "| caste-preacher (no valid reply) | 2 |" in card and "| invalid 2 |" in card
    assert "drunk-scavenger 2 |" in card and "copied" in card and "mean over registers" in card
    assert "held out: fever-medicine, held out of the adapters' training sets" in card
    assert report_lines(summary)[-1].startswith("  e.g. [drunk-scavenger]")


def test_a_stale_voice_report_is_removed_when_voice_eval_is_off(tmp_path: Path) -> None:
    from nimmer_train.runtime.demo_sessions import VOICE_FILE, voice_session
    from tests.helpers.compose import config

    stale = tmp_path / VOICE_FILE
    stale.write_text("{}")
    assert voice_session(config("publish.voice_eval.enabled=false"), None, stale, None) is None  # type: ignore[arg-type]
    assert not stale.exists()


def test_publish_takes_its_voice_measure_from_its_caller(tmp_path: Path) -> None:
    """publish sits below the runtime: publish_stage measures with the function it is given
    (run_all and pipelines.publish pass runtime.voice_eval.candidate_report), none without one."""
    from nimmer_train.publish.release import PublishRequest
    from nimmer_train.publish.stage import _voice
    from tests.helpers.compose import config

    req, calls = PublishRequest(tmp_path / "base", []), []

    def measure(cfg: object, r: PublishRequest) -> str:
        calls.append(r)
        return "report"

    assert _voice(config(), tmp_path, req, None) is None  # no registry here: not yet published
    assert _voice(config("publish.voice_eval.enabled=false"), tmp_path, req, measure) is None  # type: ignore[arg-type]
    assert _voice(config(), tmp_path, req, measure) == "report" and calls == [req]  # type: ignore[arg-type]


def test_the_seed_classifier_knows_each_registers_style() -> None:
    """The catalogue's exemplar lines (not in the seed set) land in their own register well above
    chance; the classifier's own leave-one-scene-out accuracy on the seed set is its ceiling."""
    classifier = seed_classifier(SEED_SET)
    assert classifier.registers == sorted(CATALOGUE.names)
    assert classifier.cv_accuracy is not None and classifier.cv_accuracy > 0.9
    chance = 1 / len(classifier.registers)
    for name in CATALOGUE.names:
        lines = CATALOGUE.get(name).exemplars
        accuracy = sum(p == name for p in classifier.label(lines)) / len(lines)  # abstentions miss
        assert accuracy >= 3 * chance, (name, accuracy)


def test_heldout_summary_takes_the_loss_matrix_headline() -> None:
    cell = lambda loss: {"loss": loss, "low": loss, "high": loss, "n": 4, "tokens": 90}  # noqa: E731
    evaluation = {
        "headline": {"set": "r1", "tokens": "utterance"},
        "scores": {
            "r1": {
                "utterance": {
                    "registers": ["a"],
                    "matrix": {"a": {"base": cell(3.0), "a": cell(2.5), "b": cell(2.9)}},
                    "separability": {"value": 1.0, "low": 1.0, "high": 1.0},
                    "mean_gain": {"value": 0.5, "low": 0.4, "high": 0.6},
                    "margins": {"a": {"value": 0.4, "low": 0.3, "high": 0.5}},
                }
            }
        },
    }
    summary = heldout_summary(evaluation)
    assert summary is not None and summary["separability"] == 1.0
    assert summary["registers"]["a"] == {"base": 3.0, "own": 2.5, "margin": 0.4, "n": 4}
    assert heldout_summary(None) is None


@pytest.mark.slow
def test_publish_card_and_speak_output_carry_the_voice_report(tmp_path: Path) -> None:
    """A version published here (tests/helpers/published.py): the report of what a request would
    publish goes into the new version's card and manifest; the speak stage's report of a loaded
    version is written beside its turns."""
    from nimmer_train.publish.release import PublishRequest, already_published, publish_version
    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import open_version
    from nimmer_train.runtime.demo_sessions import VOICE_FILE, voice_session
    from nimmer_train.runtime.local_model import LocalModel
    from nimmer_train.runtime.voice_eval import candidate_report
    from tests.helpers.compose import config
    from tests.helpers.published import publish_registers

    releases, trusted = publish_registers(tmp_path)
    cfg = config("publish.voice_eval.turns_per_register=2", "publish.voice_eval.max_new_tokens=24")
    base = tmp_path / "base" / "tiny-serve"
    adapters = sorted((tmp_path / "adapters").iterdir())
    assert already_published(releases, PublishRequest(base, adapters))
    req = PublishRequest(base, adapters[:2])
    report = candidate_report(cfg, req)
    assert [r.register for r in report.registers] == sorted(a.name for a in adapters[:2])
    assert report.overall.turns == 4 and report.settings["adapters"] == {a.name: a.name for a in adapters[:2]}
    req = dataclasses.replace(req, voice=report.summary())  # as publish_stage does
    version, new = publish_version(releases, tmp_path / "keys" / "publisher.key", req)
    assert new
    card = (version.folder / README).read_text()
    assert "## Voice report" in card and "**The bar**" in card and "(goal >= 0.98)" in card
    assert "no record of the adapters' training sets" in card  # the helper's adapters have no synth
    signed = open_version(releases, version.label, Keyring.load(trusted)).manifest["voice_report"]
    assert signed["version"] == version.label and signed["overall"]["turns"] == 4

    model = LocalModel.open(releases, "v1", trusted)
    try:
        spoken = voice_session(cfg, model, tmp_path / "runtime" / VOICE_FILE, None)
    finally:
        model.close()
    written = json.loads((tmp_path / "runtime" / VOICE_FILE).read_text())
    assert spoken is not None and written["version"] == "nimmerworld-base-v1"
    assert len(written["registers"]) == 3 and written["overall"]["turns"] == 6
    # the version published here records its report: speak measures as its card did
    model = LocalModel.open(releases, version.label, trusted)
    try:
        again = voice_session(config(), model, tmp_path / "runtime" / VOICE_FILE, None)
    finally:
        model.close()
    assert again is not None and again.settings["turns_per_register"] == 2
    assert again.settings["heldout_source"].startswith("recorded at publish: no record")
    assert again.overall.turns == 4 and again.settings["scenes"] == signed["settings"]["scenes"]
