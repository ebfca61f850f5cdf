"""The contributor's and operator's commands on one machine: `nimmer federation certs` (a real
TLS handshake on loopback), `nimmer contribute`'s refusals and its SuperNode's retry line naming
the address (a real flower-supernode against a port nobody serves), and the A.2 intake by files:
`nimmer contributions upload`, `nimmer federation a2 add|status|forget`, `nimmer contributions
forget` and its answer (the pool never trains on a forgotten upload again); the ClientApp a
SuperNode loads for every message imports no torch."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from nimmer_train.cli import main
from nimmer_train.federation.deploy import SuperNode, free_port, node_config, run_supernode
from nimmer_train.memory.contributions import entries
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.a2_pool import A2Pool
from tests.helpers import REPO
from tests.helpers.memory import HashEmbedder
from tests.helpers.published import publish_registers


def _tls_handshake(ca: Path, cert: Path, key: Path, name: str) -> str:
    """Serve one TLS handshake with ``cert`` on loopback; the client verifies it with ``ca`` for
    ``name``. Returns the negotiated protocol."""
    server_ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_ctx.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def accept() -> None:
        conn, _ = listener.accept()
        try:
            with server_ctx.wrap_socket(conn, server_side=True):
                pass
        except ssl.SSLError:
            pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    client_ctx = ssl.create_default_context(cafile=str(ca))
    try:
        with (
            socket.create_connection(("127.0.0.1", port)) as raw,
            client_ctx.wrap_socket(raw, server_hostname=name) as tls,
        ):
            return str(tls.version())
    finally:
        thread.join(10)
        listener.close()


def test_certs_make_a_ca_and_a_server_certificate_that_verify(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    certs = tmp_path / "certs"
    assert main(["federation", "certs", str(certs), "--host", "127.0.0.1", "--host", "localhost"]) == 0
    assert "new CA" in capsys.readouterr().out
    files = {n: certs / n for n in ("ca.crt", "ca.key", "server.crt", "server.key")}
    assert all(p.is_file() for p in files.values())
    assert (
        oct(files["ca.key"].stat().st_mode & 0o777)
        == "0o600"
        == oct(files["server.key"].stat().st_mode & 0o777)
    )
    assert _tls_handshake(files["ca.crt"], files["server.crt"], files["server.key"], "localhost").startswith(
        "TLS"
    )
    ca, server = files["ca.crt"].read_bytes(), files["server.crt"].read_bytes()
    assert main(["federation", "certs", str(certs), "--host", "127.0.0.1"]) == 0  # renewal keeps the CA
    assert "reused CA" in capsys.readouterr().out
    assert files["ca.crt"].read_bytes() == ca and files["server.crt"].read_bytes() != server
    with pytest.raises(ssl.SSLCertVerificationError):  # a name the certificate does not hold
        _tls_handshake(files["ca.crt"], files["server.crt"], files["server.key"], "fl.example")
    files["ca.key"].unlink()
    assert main(["federation", "certs", str(certs), "--host", "127.0.0.1"]) == 1
    assert "ca.key but not the other" in capsys.readouterr().err


def test_contribute_refuses_what_would_fail_mid_round(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    releases, trusted = publish_registers(tmp_path / "release", ("caste-preacher",))
    me = tmp_path / "players" / "me"
    generate_player(me, HashEmbedder(), seed=3, entries=40, player_id="player-1")  # opt-out by default
    (tmp_path / "ca.crt").write_text("not used before the checks pass")
    args = [
        "contribute", str(me), "--superlink", "127.0.0.1:9", "--root-certificates", str(tmp_path / "ca.crt"),
        "--releases", str(releases), "--version", "v1", "--trusted-keys",
    ]  # fmt: skip
    assert main([*args, str(trusted)]) == 1
    err = capsys.readouterr().err
    assert "takes no part in federated rounds: the consent tier is opt_out" in err
    assert f"nimmer consent set A1_federated {me.resolve()}" in err
    assert main(["consent", "set", "A1_federated", str(me)]) == 0
    (me / "profile.json").unlink()
    assert main([*args, str(trusted)]) == 1
    assert "profile.json is missing" in capsys.readouterr().err
    assert (
        main(["consent", "set", "A1_federated", str(me), "--player-id", "p-1", "--player-name", "Ana"]) == 0
    )
    strangers = tmp_path / "strangers"
    strangers.mkdir()
    assert main([*args, str(strangers)]) == 1  # the release's signature is checked before anything runs
    assert "not a trusted publisher key" in capsys.readouterr().err


def test_the_supernode_names_the_address_it_keeps_trying_and_leaves_on_revocation(tmp_path: Path) -> None:
    from nimmer_train.federation.certs import make_certificates

    certs = make_certificates(tmp_path / "certs", ["127.0.0.1"])
    dead = f"127.0.0.1:{free_port()}"  # nobody serves it
    node = SuperNode(
        dead, certs.ca, node_config(tmp_path, tmp_path, tmp_path, dead), free_port(), tmp_path / "home"
    )
    lines: list[str] = []
    calls = [0]

    def still_takes_part() -> str | None:
        calls[0] += 1
        named = any(f"still trying to reach the SuperLink at {dead}" in line for line in lines)
        return "consent was revoked (test)" if named and calls[0] > 1 else None

    assert run_supernode(node, still_takes_part, lines.append, retry_every=1.0, check_every=0.5) == 0
    assert any(f"still trying to reach the SuperLink at {dead} over TLS" in line for line in lines)
    assert lines[-1] == "leaving the federation: consent was revoked (test)"
    with pytest.raises(Exception, match="quote"):
        node_config(Path("/it's"), tmp_path, tmp_path, dead)


def test_a2_uploads_reach_the_pool_and_a_forget_request_drops_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pool = tmp_path / "server" / "a2_pool.sqlite"
    outbox = tmp_path / "outbox"
    devices = []
    for i in range(3):
        device = tmp_path / f"player{i}"
        generate_player(
            device, HashEmbedder(), seed=10 + i, entries=40, player_id=f"player-77{i}", tier="A2_anonymized"
        )
        assert main(["contributions", "upload", str(device), "--out", str(outbox / device.name)]) == 0
        assert "anonymised examples" in capsys.readouterr().out
        devices.append(device)
    files = sorted(outbox.rglob("a2-upload-*.json"))
    assert len(files) == 3
    assert main(["federation", "a2", "add", "--pool", str(pool), *map(str, files)]) == 0
    capsys.readouterr()
    assert main(["federation", "a2", "status", "--pool", str(pool)]) == 0
    assert json.loads(capsys.readouterr().out)["uploads"] == 3
    me = devices[0]
    (mine,) = [e["upload_id"] for e in entries(me) if e["kind"] == "a2_upload"]
    request = tmp_path / "request.json"
    assert main(["contributions", "forget", str(me), "--out", str(request)]) == 0
    assert "send it to the operator" in capsys.readouterr().out
    sent = json.loads(request.read_text())
    assert sent["upload_ids"] == [mine] and "player-770" not in request.read_text()
    assert main(["contributions", "forget", str(me)]) == 1  # nothing left to ask about
    assert "no A.2 upload left to forget" in capsys.readouterr().err
    assert main(["federation", "a2", "forget", "--pool", str(pool), str(request)]) == 0
    assert "forgot 1 upload(s)" in capsys.readouterr().out
    answer = tmp_path / "request.answer.json"
    assert json.loads(answer.read_text())["dropped"] == [mine]
    assert main(["contributions", "forget", str(devices[1]), "--answer", str(answer)]) == 1  # not theirs
    assert "never asked to forget" in capsys.readouterr().err
    assert main(["contributions", "forget", str(me), "--answer", str(answer)]) == 0
    assert "forward-only" in capsys.readouterr().out
    assert [e["kind"] for e in entries(me)] == ["a2_upload", "deletion_request", "deletion_answer"]
    assert main(["contributions", str(me)]) == 0
    shown = capsys.readouterr().out
    assert f"A.2 upload {mine}" in shown and "1 upload(s) dropped from the A.2 pool" in shown
    # the pool never trains on it again, and refuses it should it arrive once more
    mine_file = next(f for f in files if mine in f.name)
    others = sum(len(json.loads(f.read_text())["examples"]) for f in files if f != mine_file)
    opened = A2Pool(pool, 2)
    try:
        assert opened.live() == 2 and len(opened.training_examples()) == others
    finally:
        opened.close()
    assert main(["federation", "a2", "add", "--pool", str(pool), str(mine_file)]) == 0
    assert "refused 1 upload(s) their players asked forgotten" in capsys.readouterr().out
    assert not mine_file.exists()  # the intake keeps no copy of a forgotten upload


def test_a_forget_request_given_a_folder_is_written_inside_it(tmp_path: Path, capsys) -> None:
    device = tmp_path / "me"
    generate_player(device, HashEmbedder(), seed=7, entries=20, player_id="player-9", tier="A2_anonymized")
    assert main(["contributions", "upload", str(device), "--out", str(tmp_path / "outbox")]) == 0
    requests = tmp_path / "requests"
    requests.mkdir()
    assert main(["contributions", "forget", str(device), "--out", str(requests)]) == 0
    (written,) = requests.glob("deletion-request-*.json")
    assert json.loads(written.read_text())["upload_ids"] and str(written) in capsys.readouterr().out


def test_the_clientapp_a_supernode_loads_for_each_message_needs_no_torch() -> None:
    """A SuperNode runs every message in a new process that loads federated/client_app.py (each
    SecAgg+ stage is a message: four a round); only a fit trains, so only a fit imports torch
    (seconds of CPU per process, which the whole machine felt)."""
    probe = "import sys, client_app; print(sorted({'opacus', 'torch', 'transformers'} & set(sys.modules)))"
    proc = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO / "federated", capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"loading the ClientApp imported {proc.stdout.strip()}"
