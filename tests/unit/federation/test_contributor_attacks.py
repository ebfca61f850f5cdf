"""Attacks on the contributor's journey (issue 23's review), each one that worked now a test:
a key file reopened instead of replaced, a refusal that told the server why (the tier, the
revocation time), an id or name that slipped past redaction by its Unicode spelling, a
forgotten upload that blocked the intake or stayed on its disk, a reused CA that was not the
pair it claimed, a malformed answer file. Real files, real SQLite, real keys; no mocks."""

from __future__ import annotations

import json
import os
import shutil
import stat
import unicodedata
from pathlib import Path

import pytest
from cryptography import x509
from opacus.accountants import RDPAccountant

from nimmer_train.errors import NimmerError
from nimmer_train.federation.certs import make_certificates
from nimmer_train.federation.client import A1_MECHANISM, REFUSAL, Contributor, Node, federation_epsilon
from nimmer_train.federation.intake import add_uploads, apply_deletion_request, pooled_ids, write_upload
from nimmer_train.memory.consent import (
    ConsentRecord,
    a2_upload,
    get_consent,
    request_deletion,
    revoke,
    set_consent,
    takes_part,
    training_examples,
)
from nimmer_train.memory.contributions import entries
from nimmer_train.memory.deletion_requests import REQUEST_FORMAT, record_answer
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.anonymize import Upload
from tests.helpers.memory import HashEmbedder


def test_a_reader_holding_the_old_key_file_open_never_sees_the_new_key(tmp_path: Path) -> None:
    """Attack: server.key left 0644 by an earlier tool; a local user opens it and keeps the fd.
    Rewriting the same inode (O_TRUNC, chmod after) handed them the new key through that fd."""
    old = tmp_path / "server.key"
    old.write_text("an old key\n")
    os.chmod(old, 0o644)
    with old.open("rb") as held:
        made = make_certificates(tmp_path, ["127.0.0.1"])
        new_key = made.server_key.read_bytes()
        assert b"PRIVATE KEY" in new_key
        held.seek(0)
        assert held.read() == b"an old key\n"  # the new key went to a fresh inode
    for key in (made.server_key, made.ca_key):
        assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert not list(tmp_path.glob(".*.tmp-*"))  # write_secret's temp names


def test_a_link_planted_at_the_key_path_receives_nothing(tmp_path: Path) -> None:
    elsewhere = tmp_path / "public" / "loot"
    elsewhere.parent.mkdir()
    elsewhere.write_text("")
    certs = tmp_path / "certs"
    certs.mkdir()
    (certs / "server.key").symlink_to(elsewhere)
    made = make_certificates(certs, ["127.0.0.1"])
    assert elsewhere.read_text() == "" and not made.server_key.is_symlink()


def test_a_reused_ca_must_be_a_private_matching_valid_ca(tmp_path: Path) -> None:
    a, b = make_certificates(tmp_path / "a", ["127.0.0.1"]), make_certificates(tmp_path / "b", ["127.0.0.1"])
    again = make_certificates(tmp_path / "a", ["127.0.0.1"])
    assert again.ca_reused and again.ca.read_bytes() == a.ca.read_bytes()
    ca = x509.load_pem_x509_certificate(again.ca.read_bytes())
    server = x509.load_pem_x509_certificate(again.server.read_bytes())
    server.verify_directly_issued_by(ca)
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    shutil.copy(a.ca, mixed / "ca.crt")
    shutil.copy(b.ca_key, mixed / "ca.key")
    os.chmod(mixed / "ca.key", 0o600)
    with pytest.raises(NimmerError, match="is not the key of"):
        make_certificates(mixed, ["127.0.0.1"])
    leaf = tmp_path / "leaf"  # a server certificate and key passed off as the CA
    leaf.mkdir()
    shutil.copy(a.server, leaf / "ca.crt")
    shutil.copy(a.server_key, leaf / "ca.key")
    with pytest.raises(NimmerError, match="is not a CA certificate"):
        make_certificates(leaf, ["127.0.0.1"])
    os.chmod(a.ca_key, 0o644)
    with pytest.raises(NimmerError, match="readable by others"):
        make_certificates(tmp_path / "a", ["127.0.0.1"])


def _device(folder: Path, tier: str, player_name: str = "Marta") -> Path:
    generate_player(
        folder,
        HashEmbedder(),
        seed=7,
        entries=30,
        player_id="player-4c1d",
        player_name=player_name,
        tier=tier,
    )
    return folder


ROUND_CONFIG = {
    "round": 3, "local.steps": 1, "local.batch-size": 2, "local.lr": 1e-3, "local.max-length": 32,
    "local.max-examples": 8, "local-dp.noise-multiplier": 1.0, "local-dp.max-grad-norm": 1.0,
    "local-dp.grad-sample-mode": "hooks", "seed": 0, "delta": 1e-5,
}  # fmt: skip


@pytest.mark.parametrize("tier", ["revoked", "A2_anonymized", "opt_out"])
def test_a_refusal_tells_the_server_nothing_but_that_it_refused(tmp_path: Path, tier: str) -> None:
    """Attack: Flower sends the ClientApp's exception text to the server. The refusal said
    'consent was revoked at <time>' or 'the consent tier is A2_anonymized': the tier and a
    timestamp that fingerprints the player left the device."""
    device = _device(tmp_path / "me", "A1_federated" if tier == "revoked" else tier)
    if tier == "revoked":
        memory = PlayerMemory(device, HashEmbedder())
        revoke(memory, now=1_767_225_600.0)
        memory.close()
    client = Contributor(Node(tmp_path / "base", tmp_path / "adapter", device=device, federation="fl:8000"))
    with pytest.raises(NimmerError) as refused:
        client.fit([], dict(ROUND_CONFIG))
    assert str(refused.value) == REFUSAL
    for secret in ("revoked", "2026", "A2_anonymized", "opt_out", "tier"):
        assert secret not in str(refused.value)
    (logged,) = [e for e in entries(device) if e["kind"] != "consent_revoked"]  # the reason stays here
    assert logged["kind"] == "refused" and ("revoked" if tier == "revoked" else tier) in logged["reason"]


def test_no_spelling_of_the_players_id_or_name_reaches_an_upload(tmp_path: Path) -> None:
    """Attack: the same name in another Unicode spelling (decomposed accent, full-width letters,
    zero-width characters, a non-breaking hyphen, an underscore or a space in the id) passed the
    redaction untouched."""
    device = _device(tmp_path / "me", "A2_anonymized", player_name="Zoë")
    memory = PlayerMemory(device, HashEmbedder())
    try:
        set_consent(memory, ConsentRecord("A2_anonymized", ("casual_dialog",), (), 1.0))
        nfd = unicodedata.normalize("NFD", "Zoë")
        planted = [
            (f"{nfd} met the warden", nfd),
            ("ＺＯＥ\u0308 and Z\u200bo\u200dë waved", "npc:tess"),
            ("ping player\u20114c1d or PLAYER\u00ad-4C1D, player_4c1d, Player 4c1d", "npc:tess"),
        ]
        for text, speaker in planted:
            memory.write(text, speaker=speaker, memory_class="working", data_category="casual_dialog")
        shared = training_examples(memory, "A2_anonymized", "player-4c1d", "Zoë")
        upload = a2_upload(memory, "player-4c1d", "Zoë")
    finally:
        memory.close()
    assert upload is not None
    mine = [e for e in shared if any(w in e["text"] for w in ("met the warden", "waved", "ping "))]
    assert len(mine) == 3
    for examples in (shared, upload.examples):
        for e in examples:
            folded = unicodedata.normalize("NFKD", e["text"] + " " + e["speaker"]).casefold()
            plain = "".join(c for c in folded if c.isalnum())
            assert "zoe" not in plain and "4c1d" not in plain, e


def _pool(tmp_path: Path, secret: str) -> tuple[Path, list[Path]]:
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    files = [
        write_upload(
            Upload(
                f"upload-{i}", ({"text": f"{secret} {i} " + "x" * 6000, "data_category": "casual_dialog"},)
            ),
            inbox,
        )
        for i in range(3)
    ]
    pool = tmp_path / "server" / "a2_pool.sqlite"
    assert add_uploads(pool, files, 1) == ([f"upload-{i}" for i in range(3)], [])
    return pool, files


def _request(path: Path, ids: list[str]) -> Path:
    path.write_text(json.dumps({"format": REQUEST_FORMAT, "upload_ids": ids, "requested_at": 0.0}))
    return path


def test_a_forgotten_upload_stays_in_no_byte_of_the_pool_and_never_blocks_the_intake(tmp_path: Path) -> None:
    """Attacks: (1) re-adding the inbox after a forget (the documented `a2 add inbox/*.json`)
    aborted the whole batch at the forgotten file, so new uploads were never pooled and the
    forgotten data stayed in the inbox; (2) the forgotten text must leave the pool's files too
    (SQLite keeps freed pages unless secure_delete: Debian's build zeroes them by default, so
    here this half guards the explicit setting)."""
    secret = "kestrel-violet-ledger"
    pool, files = _pool(tmp_path, secret)
    answer = apply_deletion_request(pool, _request(tmp_path / "req.json", ["upload-0"]), 1)
    assert answer["dropped"] == ["upload-0"]
    on_disk = b"".join(p.read_bytes() for p in pool.parent.iterdir())
    assert f"{secret} 0".encode() not in on_disk and f"{secret} 1".encode() in on_disk
    new = write_upload(
        Upload("upload-9", ({"text": "new", "data_category": "casual_dialog"},)), files[0].parent
    )
    assert add_uploads(pool, sorted(files[0].parent.glob("a2-upload-*.json")), 1) == (
        ["upload-1", "upload-2", "upload-9"],
        ["upload-0"],
    )
    assert pooled_ids(pool, 1) == ["upload-1", "upload-2", "upload-9"]
    assert not files[0].exists() and new.exists()


def test_a_replayed_request_drops_nothing_more_and_an_answer_must_be_well_formed(tmp_path: Path) -> None:
    pool, _ = _pool(tmp_path, "replay")
    request = _request(tmp_path / "req.json", ["upload-1"])
    assert apply_deletion_request(pool, request, 1)["dropped"] == ["upload-1"]
    again = apply_deletion_request(pool, request, 1)
    assert again["dropped"] == [] and again["blocked"] == ["upload-1"]
    assert pooled_ids(pool, 1) == ["upload-0", "upload-2"]
    for bad in ([{"upload_ids": "upload-0"}], [{"upload_ids": ["../../etc/passwd", 3]}]):
        with pytest.raises(NimmerError, match="upload_ids must be a list"):
            apply_deletion_request(pool, _request(tmp_path / "bad.json", bad[0]["upload_ids"]), 1)
    assert pooled_ids(pool, 1) == ["upload-0", "upload-2"]
    device = _device(tmp_path / "me", "A2_anonymized")
    answer = tmp_path / "answer.json"
    answer.write_text(json.dumps({"format": "nimmer-a2-deletion-answer/1", "dropped": "upload-0"}))
    memory = PlayerMemory(device, HashEmbedder())
    try:
        with pytest.raises(NimmerError, match="dropped must be a list"):
            record_answer(memory, answer)
    finally:
        memory.close()


def test_the_logged_epsilon_is_opacus_rdp_of_the_announced_mechanism() -> None:
    """Recomputed independently: Opacus's RDPAccountant stepped once per released round."""
    z, q, delta = 0.9, 0.25, 1e-5
    for released in (0, 1, 4):
        config = dict(zip(A1_MECHANISM, (z, q, released), strict=True)) | {"delta": delta}
        accountant = RDPAccountant()
        for _ in range(released + 1):
            accountant.step(noise_multiplier=z, sample_rate=q)
        assert federation_epsilon(config) == pytest.approx(accountant.get_epsilon(delta=delta), rel=1e-9)


def test_consent_revoked_while_the_device_trains_keeps_the_update_on_it(tmp_path: Path) -> None:
    """Attack: consent was read once, before training (seconds to minutes); a revocation during
    training still let the update leave afterwards. The device now asks again before it answers.
    The revocation is made, from another connection, the moment training starts (a profile
    hook on the real train_locally: nothing of ours is replaced)."""
    import sys

    from nimmer_train.config.federated import FederatedConfig, LocalRecipeConfig, UserDPConfig
    from nimmer_train.federation.local_training import load_trainable
    from nimmer_train.federation.strategy import NoisyMean, fit_config
    from nimmer_train.federation.wire import get_arrays, spec_of
    from nimmer_train.publish.signing import Keyring
    from nimmer_train.publish.versions import open_version
    from tests.helpers.published import publish_registers

    releases, trusted = publish_registers(tmp_path / "release", ("caste-preacher",))
    version = open_version(releases, "v1", Keyring.load(trusted))
    release = (version.folder, version.loras["caste-preacher"])
    device = _device(tmp_path / "me", "A1_federated")
    memory = PlayerMemory(device, HashEmbedder())
    try:
        set_consent(memory, ConsentRecord("A1_federated", ("casual_dialog", "memorial_archive"), (), 1.0))
        assert takes_part(get_consent(memory)) is None and training_examples(
            memory, "A1_federated", "player-4c1d", "Marta"
        )
    finally:
        memory.close()
    settings = FederatedConfig(
        user_dp=UserDPConfig(noise_multiplier=0.8, fraction_fit=0.5),
        local=LocalRecipeConfig(steps=1, batch_size=4),
    )
    model = load_trainable(*release)[0]
    spec = spec_of(model)
    config = NoisyMean(settings, spec, fit_config(settings, spec)).strategy.on_fit_config_fn(1)
    client = Contributor(Node(*release, device=device, federation="fl:8000"))

    def revoke_when_training_starts(frame, event, arg):  # noqa: ANN001, ANN202 - sys.setprofile's
        if event == "call" and frame.f_code.co_name == "train_locally":
            sys.setprofile(None)
            memory = PlayerMemory(device, HashEmbedder())
            try:
                revoke(memory)
            finally:
                memory.close()

    sys.setprofile(revoke_when_training_starts)
    try:
        with pytest.raises(NimmerError, match=REFUSAL):
            client.fit(get_arrays(model), config)
    finally:
        sys.setprofile(None)
    assert [e["kind"] for e in entries(device)] == ["consent_revoked", "refused"]  # no round: nothing left


def test_an_entry_goes_into_one_upload_only_so_a_forgotten_one_never_returns(tmp_path: Path) -> None:
    """Attacks: (1) every upload re-sent every shareable entry, so the pool held one record many
    times (its record-level accounting counts each example once, and one device could fill the
    k threshold alone); (2) after `nimmer contributions forget`, the next upload sent the very
    entries the player had asked forgotten, under a new id."""
    device = _device(tmp_path / "me", "A2_anonymized")
    memory = PlayerMemory(device, HashEmbedder())
    try:
        set_consent(memory, ConsentRecord("A2_anonymized", ("casual_dialog", "memorial_archive"), (), 1.0))
        first = a2_upload(memory, "player-4c1d", "Marta")
        assert first is not None and first.examples
        assert a2_upload(memory, "player-4c1d", "Marta") is None  # nothing new: nothing sent
        request_deletion(memory)  # the player asks the first upload forgotten
        memory.write(
            "the ferry left at dawn",
            speaker="npc:ilse",
            memory_class="working",
            data_category="casual_dialog",
        )
        later = a2_upload(memory, "player-4c1d", "Marta")
    finally:
        memory.close()
    assert later is not None and [e["text"] for e in later.examples] == ["the ferry left at dawn"]
    assert not {e["text"] for e in first.examples} & {e["text"] for e in later.examples}
    logged = [e for e in entries(device) if e["kind"] == "a2_upload"]
    assert [len(e["entries"]) for e in logged] == [len(first.examples), 1]
    sent = json.dumps([first.examples, later.examples])
    assert not any(uid in sent for e in logged for uid in e["entries"])  # uids stay on the device


def test_contribute_refuses_a_tampered_release_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attack: one flipped bit in the base or the register LoRA of a signed version."""
    from nimmer_train.cli import main
    from tests.helpers.published import publish_registers

    releases, trusted = publish_registers(tmp_path / "release", ("caste-preacher",))
    device = _device(tmp_path / "me", "A1_federated")
    memory = PlayerMemory(device, HashEmbedder())
    try:
        set_consent(memory, ConsentRecord("A1_federated", ("casual_dialog",), (), 1.0))
    finally:
        memory.close()
    (tmp_path / "ca.crt").write_text("never read: the release is refused first")
    args = [
        "contribute", str(device), "--superlink", "127.0.0.1:9", "--root-certificates",
        str(tmp_path / "ca.crt"), "--releases", str(releases), "--version", "v1",
        "--trusted-keys", str(trusted),
    ]  # fmt: skip
    for weights in sorted(releases.rglob("*.safetensors")):  # the LoRA's, then the base's
        original = weights.read_bytes()
        weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert main(args) == 1
        assert "does not match its sha256" in capsys.readouterr().err
        assert not (device / ".flower").exists()  # no SuperNode was started
        weights.write_bytes(original)


def test_a_request_that_could_not_be_written_can_be_asked_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Attack: the uploads were marked asked before the request file was written; a write that
    failed left no request and nothing to ask again, so the player could never be forgotten."""
    from nimmer_train.cli import main

    device = _device(tmp_path / "me", "A2_anonymized")
    memory = PlayerMemory(device, HashEmbedder())
    try:
        set_consent(memory, ConsentRecord("A2_anonymized", ("casual_dialog", "memorial_archive"), (), 1.0))
        upload = a2_upload(memory, "player-4c1d", "Marta")
    finally:
        memory.close()
    assert upload is not None
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    blocked = not_a_folder / "request.json"  # its parent is a file: the write fails
    assert main(["contributions", "forget", str(device), "--out", str(blocked)]) == 1
    assert "could not write the deletion request" in capsys.readouterr().err
    request = tmp_path / "request.json"
    assert main(["contributions", "forget", str(device), "--out", str(request)]) == 0
    assert json.loads(request.read_text())["upload_ids"] == [upload.upload_id]
    assert [e["kind"] for e in entries(device)] == ["a2_upload", "deletion_request"]
