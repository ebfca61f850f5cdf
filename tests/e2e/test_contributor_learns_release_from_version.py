"""A contributor who left a federation early (consent revoked after round 3) never hears the
server's outcome message, so round 3 stays "pending" in its log; once the device pulls the signed
version that merged the federation's adapter, ``nimmer contributions`` shows round 3 as released
in that version with its published A.1 epsilon, and round 2 (which the federation did not
release) as not released. A manifest changed after signing is refused and the log is unchanged.

Real parts throughout: the federation's adapter is written by ``results.publish_federated`` from a
server state whose ledger accounts the released rounds (the rounds themselves are not run: a
federation is tests/unit/federation's and the e2e pipeline's), its id is the work-dir's
(``rounds.federation_id``), the version is published and signed by ``publish_version``, the
device pulls it over HTTP on loopback and the device's log is written by the function the
Flower client calls, with the fields it passes."""

from __future__ import annotations

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import pytest

from nimmer_train.artifacts import write_json_atomic
from nimmer_train.cli import main
from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.budget import a1_step
from nimmer_train.federation.checkpoint import ServerState
from nimmer_train.federation.local_training import load_trainable
from nimmer_train.federation.results import publish_federated
from nimmer_train.federation.rounds import federation_id
from nimmer_train.loras.adapters import METADATA, read_metadata
from nimmer_train.memory import contributions
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.publish.release import PublishRequest, publish_version
from tests.helpers.loopback import serve_app
from tests.helpers.memory import HashEmbedder
from tests.unit.publish.test_versions_pull import Mirror

REGISTER = "caste-preacher"
V2 = "nimmerworld-base-v2"
ADDRESS = "fl.example:9092"


@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, str, float]:
    """(publisher's releases, trusted keys, the federation's id, its published A.1 epsilon): v1 a
    plain base, v2 with a federation's adapter merged in whose rounds 1 and 3 were released and
    round 2 was not (too few updates)."""
    from tests.helpers.published import publish_registers

    root = tmp_path_factory.mktemp("operator")
    releases, trusted = publish_registers(root, registers=(REGISTER,))
    settings = FederatedConfig(rounds=3)
    settings.user_dp.population_size = 100
    settings.user_dp.fraction_fit = 0.1
    ledger = Ledger(settings.delta)
    records = []
    for r, accepted in ((1, True), (2, False), (3, True)):
        record = {"round": r, "accepted": accepted, "a1_contributions_noised": 9.7}
        if accepted:
            record.update(ledger.record(a1_step(settings)))
            record["round"] = r
        else:
            record["reason"] = "fewer A.1 updates than min_participants"
        records.append(record)
    state = ServerState(round=3, stopped="completed", records=records, ledger=asdict(ledger))
    work = root / "server" / "rounds"
    ident = federation_id(work)  # made with its ledger, as the server does
    start = root / "start" / REGISTER  # the register LoRA the federation starts from, as train_loras
    shutil.copytree(root / "adapters" / REGISTER, start)  # names it: with the synthetic set it learned
    write_json_atomic(start / METADATA, {**read_metadata(start), "datasets": {"synth": "5" * 16}})
    model, _ = load_trainable(root / "base" / "tiny-serve", start)
    out = root / "federated" / "adapter"
    meta = publish_federated(out, model, start, "f" * 64, settings, state, federation_id=ident)
    key = root / "keys" / "publisher.key"
    publish_version(
        releases,
        key,
        PublishRequest(root / "base" / "tiny-serve", [], merge_adapter=out),  # its register's voice merged
    )
    return releases, trusted, ident, meta["federation"]["epsilon_a1_user_level"]


def _device(folder: Path, ident: str) -> Path:
    """A player whose device trained rounds 1-3 and heard, in round 3's instructions, that round
    1 was released and round 2 was not; then its consent was revoked (no outcome message)."""
    generate_player(folder, HashEmbedder(), seed=3, entries=20, tier="A1_federated")
    told = {1: {"rounds_done": 0, "not_released": []}, 2: {"rounds_done": 1, "not_released": []}}
    told[3] = {"rounds_done": 2, "not_released": [2]}
    for r in (1, 2, 3):
        contributions.record(
            folder, "round", federation=ADDRESS, federation_id=ident, round=r, tier="A1_federated",
            left="the masked update", examples_used=12, epsilon=0.5 * r, epsilon_local=2.0,
            delta=1e-5, outcome=told[r],
        )  # fmt: skip
    contributions.record(folder, "consent_revoked")
    return folder


def _show(player: Path, device: Path, trusted: Path) -> int:
    argv = ["contributions", str(player), "--releases", str(device), "--trusted-keys", str(trusted)]
    return main(argv)


def _lines_about(out: str, round_: int) -> str:
    (line,) = [x for x in out.splitlines() if f"round {round_} of {ADDRESS}" in x]
    return line


def test_a_pulled_signed_version_releases_the_rounds_a_device_never_heard_of(
    published: tuple[Path, Path, str, float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, trusted, ident, epsilon = published
    player, device = _device(tmp_path / "me", ident), tmp_path / "device" / "releases"
    assert _show(player, device, trusted) == 0  # nothing pulled yet: as the server told
    out = capsys.readouterr().out
    assert "if this round is released" in _lines_about(out, 3)
    assert "round not released" in _lines_about(out, 2)
    with serve_app(Mirror(releases)) as url:
        pull = ["versions", "--releases", str(device), "--trusted-keys", str(trusted), "pull", f"{url}/{V2}"]
        assert main(pull) == 0
    capsys.readouterr()
    assert _show(player, device, trusted) == 0
    out = capsys.readouterr().out
    assert f"round released in {V2} (signed; its epsilon {epsilon:.4g}, A.1 user-level" in _lines_about(
        out, 3
    )
    assert f"round released in {V2}" in _lines_about(out, 1)
    assert "round not released" in _lines_about(out, 2)
    assert "if this round is released" not in out
    assert f"2 released (released in {V2}, signed), 1 not released" in out
    spend = contributions.spend(player)[ident]
    assert (spend["released"], spend["not_released"], spend["pending"], spend["epsilon"]) == (
        2,
        1,
        0,
        epsilon,
    )
    published_entries = [e for e in contributions.entries(player) if e["kind"] == "published"]
    assert [(e["label"], e["rounds_released"], e["rounds_done"]) for e in published_entries] == [
        (V2, [1, 3], 3)
    ]
    assert _show(player, device, trusted) == 0  # shown again: recorded once
    assert len([e for e in contributions.entries(player) if e["kind"] == "published"]) == 1
    assert "player" not in json.dumps(published_entries)  # the federation's id, never a player's


def test_a_manifest_changed_after_signing_is_refused_and_the_log_is_unchanged(
    published: tuple[Path, Path, str, float], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, trusted, ident, _ = published
    player, device = _device(tmp_path / "me", ident), tmp_path / "device" / "releases"
    assert (
        main(
            [
                "versions",
                "--releases",
                str(device),
                "--trusted-keys",
                str(trusted),
                "pull",
                str(releases / V2),
            ]
        )
        == 0
    )
    manifest = device / V2 / "manifest.json"
    text = manifest.read_text()
    assert '"rounds_released": [\n' in text or '"rounds_released": [1, 3]' in text
    data = json.loads(text)
    data["merged_adapter"]["rounds_released"] = [1, 2, 3]  # a round the federation did not release
    manifest.write_text(json.dumps(data, indent=2, sort_keys=True))
    before = (player / contributions.LOG_FILE).read_bytes()
    capsys.readouterr()
    assert _show(player, device, trusted) == 1
    captured = capsys.readouterr()
    (err,) = captured.err.strip().splitlines()
    assert err.startswith(f"refused {V2}:") and "signature does not verify" in err
    assert (player / contributions.LOG_FILE).read_bytes() == before
    assert "if this round is released" in _lines_about(captured.out, 3)  # still as the server told
    shutil.rmtree(device / V2)  # a version folder gone (deleted by hand): refused, nothing believed
    assert _show(player, device, trusted) == 1
    assert "missing or not a regular file" in capsys.readouterr().err
    assert (player / contributions.LOG_FILE).read_bytes() == before
