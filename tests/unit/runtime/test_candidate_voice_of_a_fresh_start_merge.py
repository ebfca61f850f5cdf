"""The voice report that gates a publish (runtime.voice_eval.candidate_report / candidate_model)
must speak what the version will ship. A fresh start adapter the population trained
(federated.start_rank > 0, metadata ``fresh_start``) merged into the weights is the base's change,
not a register's voice (artifacts.merged_voice): the published version keeps that register's LoRA
and its runtime speaks the register through it. The candidate model must do the same, or the
card's voice report and the sign-off's voice goals measure that register on the bare weights; and
the fresh adapter, trained on no synthetic set, must not erase the register LoRAs' record of the
scenes held out of their training (the report would fall back to the config's and say 'no
record').

Review of 857f015: both failed there; 81f1287 fixed the first (candidate_model through
artifacts.merged_voice), kept here as its regression test; the second still fails
(candidate_report hands the merge adapter to heldout_of_adapters whatever it is)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.helpers.published import REGISTERS, publish_registers


def _request(root: Path):  # noqa: ANN202 - (PublishRequest, registers)
    from nimmer_train.artifacts import merged_voice
    from nimmer_train.config.federated import FederatedConfig
    from nimmer_train.federation.start import fresh_start_adapter
    from nimmer_train.loras.adapters import read_metadata
    from nimmer_train.publish.release import PublishRequest

    warnings.filterwarnings("ignore")
    registers = REGISTERS[:2]
    publish_registers(root, registers)
    base = root / "base" / "tiny-serve"
    adapters = [root / "adapters" / r for r in registers]
    fresh = fresh_start_adapter(
        base, FederatedConfig(start_rank=1, start_layers=1), registers[0], root / "federated"
    )
    meta = read_metadata(fresh)
    assert meta["register"] == registers[0] and merged_voice(meta) is None  # what publish reads
    return PublishRequest(base, adapters, merge_adapter=fresh), registers


def test_the_candidate_speaks_a_fresh_start_register_through_its_lora(tmp_path: Path) -> None:
    from nimmer_train.runtime.voice_eval import candidate_model

    req, registers = _request(tmp_path)
    with candidate_model(req) as model:
        # as the published version's runtime (LocalModel: merged_voice of the signed manifest)
        assert model.merged_register is None
        assert set(model.registers) == set(registers)
        assert model.adapter_for(registers[0]) == registers[0]


def test_a_fresh_merge_keeps_the_loras_recorded_heldout_scenes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nimmer_train.artifacts import synth_path, write_json_atomic, write_manifest
    from nimmer_train.loras.adapters import METADATA, read_metadata
    from nimmer_train.runtime import voice_eval
    from tests.helpers.compose import config

    req, _ = _request(tmp_path)
    artifacts = tmp_path / "artifacts"
    fp = "e" * 64
    write_json_atomic(synth_path(artifacts, "demo", fp) / "stats.json", {"heldout_scenes": ["ferry-dock"]})
    for adapter in req.loras:  # the register LoRAs record the synthetic set they were trained on
        meta = read_metadata(adapter)
        write_json_atomic(adapter / METADATA, {**meta, "datasets": {"synth": fp}})
        write_manifest(adapter, "register_adapter", f"serve-{adapter.name}", {})
    assert voice_eval.heldout_of_adapters(req.loras, artifacts).scenes == ("ferry-dock",)

    seen = {}
    monkeypatch.setattr(voice_eval, "voice_eval", lambda *args, **kw: seen.setdefault("heldout", args[4]))
    voice_eval.candidate_report(config(f"paths.artifacts={artifacts}"), req)
    assert seen["heldout"].scenes == ("ferry-dock",), seen["heldout"].source
