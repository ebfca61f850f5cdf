"""The contributor's journey and the operator's, following docs/federation-deployment.md command
by command on loopback: `nimmer federation certs`, a signed release, `nimmer consent set` on
four players, two A.2 uploads through `nimmer contributions upload` and `nimmer federation a2
add`, the TLS SuperLink, the A.2 SuperNode, two devices joining with `nimmer contribute`, and
`flwr run federated` for two rounds. Then: each device's `nimmer contributions` shows the rounds
with the ledger's epsilon; one device revokes consent (its `nimmer contribute` leaves); an A.2
player asks to be forgotten and the operator applies it; the next federation (one round) runs
without the revoked device, which is not counted, and without the forgotten upload. The planted
ids of all four players are searched for in everything the server side holds.

The deployment spends most of its time in Flower's 3-second polls, so tests/conftest.py starts
:func:`journey` in the background when the session begins (only when this test is selected) and
the ``flower_two_rounds`` fixture hands the test its outcome.

Issue 42: each device keys its spend by the federation's id (the two federations share one
SuperLink address, and keep two ledgers with a total), learns from the server which rounds were
released, logs its revocation; each federation's MLflow run ends FINISHED, tagged and with its
run config; `flwr log` ends with both epsilons and the output folder.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import pytest
from mlflow.tracking import MlflowClient

from nimmer_train.federation.deploy import ANSI
from nimmer_train.federation.intake import pooled_ids
from nimmer_train.loras.adapters import read_metadata
from nimmer_train.memory.contributions import entries
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import open_version
from tests.helpers import REPO
from tests.helpers.flower_deployment import BIN, deployment, free_ports, nimmer
from tests.helpers.memory import HashEmbedder
from tests.helpers.published import publish_registers

REGISTER = "caste-preacher"
TIERS = ("A1_federated", "A1_federated", "A2_anonymized", "A2_anonymized")


def _players(work: Path) -> tuple[list[Path], list[str]]:
    """Four players' folders (stand-ins for the game's: stores filled by the generator, opt-out
    as the game leaves them) and the identifiers planted in them."""
    folders, planted = [], []
    for i in range(len(TIERS)):
        folder = work / "players" / f"player{i}"
        player_id, name = f"player-9d{i}e7c1a", f"Okonkwo{i}Vey"
        generate_player(
            folder, HashEmbedder(), seed=40 + i, entries=40, player_id=player_id, player_name=name
        )
        folders.append(folder)
        planted += [player_id, name]
    return folders, planted


def _wait_exit(proc: Any, timeout: float = 600) -> int:
    deadline = time.monotonic() + timeout  # a hang guard, not a speed bound
    while proc.poll() is None:
        assert time.monotonic() < deadline, f"process {proc.pid} still running after {timeout} s"
        time.sleep(0.5)
    return int(proc.returncode)


def journey(work: Path) -> dict[str, Any]:
    home = work / "home-nimmer"
    # the operator: certificates, and the release the federation improves (base + register LoRA)
    nimmer(
        "federation", "certs", str(work / "certs"), "--host", "127.0.0.1", "--host", "localhost", home=home
    )
    releases, trusted = publish_registers(work / "release", (REGISTER,))
    version = open_version(releases, "v1", Keyring.load(trusted))
    base, adapter = version.folder, version.loras[REGISTER]
    pool, inbox = work / "server" / "a2_pool.sqlite", work / "server" / "inbox"
    # the players: consent (and the profile the device redacts with), A.2 uploads to the intake
    players, planted = _players(work)
    for folder, tier, i in zip(players, TIERS, range(len(TIERS)), strict=True):
        player_id, name = planted[2 * i], planted[2 * i + 1]
        nimmer(
            "consent", "set", tier, str(folder), "--player-id", player_id, "--player-name", name, home=home
        )
    a1, a2 = players[:2], players[2:]
    for folder in a2:
        nimmer("contributions", "upload", str(folder), "--out", str(work / "outbox" / folder.name), home=home)
        for upload in (work / "outbox" / folder.name).glob("a2-upload-*.json"):  # delivered to the operator
            (inbox / upload.name).parent.mkdir(parents=True, exist_ok=True)
            upload.replace(inbox / upload.name)
    nimmer("federation", "a2", "add", "--pool", str(pool), *map(str, sorted(inbox.iterdir())), home=home)
    release = f"base-dir='{base}' adapter-dir='{adapter}'"
    run_config = (
        f'base-dir="{base}" adapter-dir="{adapter}" a2-pool="{pool}" '
        f'tracking-uri="sqlite:///{work / "mlflow.db"}" '
        "local.steps=2 user-dp.noise-multiplier=0.01 a2.k=1 user-dp.population-size=3 "
    )
    result: dict[str, Any] = {"planted": planted, "a1": a1, "a2": a2, "pool": pool}
    with deployment(work / "flower", work / "certs") as flower:
        flower.start(
            "a2-node",
            [
                str(BIN / "flower-supernode"),
                *("--superlink", flower.address, "--root-certificates", str(flower.ca)),
                *("--port", str(free_ports(1)[0]), "--node-config", f"{release} a2-pool='{pool}'"),
            ],
        )
        contributors = {
            folder.name: flower.start(
                folder.name,
                [
                    str(BIN / "nimmer"),
                    *("contribute", str(folder), "--superlink", flower.address),
                    *("--root-certificates", str(flower.ca), "--releases", str(releases), "--version", "v1"),
                    *("--register", REGISTER, "--trusted-keys", str(trusted)),
                ],
            )
            for folder in a1
        }
        flower.wait_nodes(3)
        started = time.monotonic()
        flower.run(
            REPO / "federated",
            run_config + f'work-dir="{work / "server/rounds"}" out-dir="{work / "out"}" rounds=2 '
            "min-participants=2",  # the two A.1 devices: the threshold counts real A.1 updates only
        )
        result["run_seconds"] = time.monotonic() - started
        result["shown"] = {f.name: nimmer("contributions", str(f), home=home).stdout for f in a1}
        # one device revokes consent: its running `nimmer contribute` leaves the federation
        nimmer("consent", "revoke", str(a1[1]), home=home)
        result["revoked_exit"] = _wait_exit(contributors[a1[1].name])
        # an A.2 player asks to be forgotten; the operator applies the request; the answer is recorded
        request = work / "outbox" / "deletion-request.json"
        nimmer("contributions", "forget", str(a2[0]), "--out", str(request), home=home)
        (work / "server" / "requests").mkdir(parents=True)
        received = work / "server" / "requests" / request.name
        request.replace(received)
        nimmer("federation", "a2", "forget", "--pool", str(pool), str(received), home=home)
        nimmer(
            "contributions",
            "forget",
            str(a2[0]),
            "--answer",
            str(received.with_suffix(".answer.json")),
            home=home,
        )
        result["pooled_after_forget"] = pooled_ids(pool, 1)
        # the next federation: the revoked device is gone, the forgotten upload with it
        flower.wait_nodes(2, exactly=True)
        flower.run(
            REPO / "federated",
            run_config.replace("user-dp.population-size=3", "user-dp.population-size=2")
            + f'work-dir="{work / "server/rounds2"}" out-dir="{work / "out2"}" rounds=1 min-participants=1',
        )
        result["logs"] = {name: flower.log(name) for name in contributors}
        result["shown_after"] = nimmer("contributions", str(a1[0]), home=home).stdout
        stopping = time.monotonic()
    # the server's side: the SuperLink's log, the A.2 node's (server-operated), everything the
    # ServerApp wrote, the pool, the intake's files and the MLflow store; devices' own files not
    server_side = [work / "flower/logs/superlink.log", work / "flower/logs/a2-node.log", work / "mlflow.db"]
    run_logs = sorted((work / "flower/logs").glob("run-*.log"), key=lambda p: p.stat().st_mtime)
    result["run_logs"] = [p.read_text() for p in run_logs]
    server_side += run_logs  # the ServerApp's, as `flwr log` shows it
    server_side += [
        p for folder in ("out", "out2", "server") for p in (work / folder).rglob("*") if p.is_file()
    ]
    result["hits"] = [
        (str(p), t) for p in server_side for t in planted if t.lower().encode() in p.read_bytes().lower()
    ]
    result.update(
        killed=flower.killed,
        shutdown_seconds=time.monotonic() - stopping,
        all_exited=all(p.poll() is not None for p in flower.processes),
        out=work / "out",
        out2=work / "out2",
        store=work / "mlflow.db",
    )
    return result


def _message(line: str) -> str:
    """A log line's message, without Flower's level prefix (``INFO :      ``)."""
    return re.sub(r"^\s*(\d\d/\d\d/\d{4} [\d:]+:)?\s*(DEBUG|INFO|WARNING|ERROR)\s*:\s*", "", line).strip()


def _records(out: Path) -> list[dict[str, Any]]:
    """The server's exact round records: its private checkpoint (rounds.json publishes no node count)."""
    work = out.parent / "server" / {"out": "rounds", "out2": "rounds2"}[out.name]
    return json.loads((work / "state.json").read_text())["records"]


@pytest.mark.slow
def test_contributors_join_see_their_spend_leave_and_are_forgotten(flower_two_rounds: dict[str, Any]) -> None:
    result = flower_two_rounds
    assert len(result["planted"]) == 8 and result["hits"] == []
    assert result["killed"] == [] and result["shutdown_seconds"] < 30 and result["all_exited"]
    first = _records(result["out"])
    assert [(r["round"], r["participants"], r["accepted"]) for r in first] == [(1, 3, True), (2, 3, True)]
    (published,) = result["out"].iterdir()
    fed = read_metadata(published)["federation"]
    # counts are noised estimates: 2 A.1 devices at z = 0.01 round to 2; the A.2 uploads carry noise
    assert fed["counts_noised"] and fed["contributors_a1"] == 2 and fed["epsilon_a2_record_level"] > 0
    client = MlflowClient(tracking_uri=f"sqlite:///{result['store']}")
    runs = client.search_runs([client.get_experiment_by_name("nimmer-federate").experiment_id])
    assert sorted(len(client.get_metric_history(r.info.run_id, "epsilon_a1_user_level")) for r in runs) == [
        1,
        2,
    ]
    # each device's log: both rounds, the ledger's epsilon after each, and what left it
    for folder in result["a1"]:
        rounds = [e for e in entries(folder) if e["kind"] == "round"][:2]
        assert [e["round"] for e in rounds] == [1, 2]
        assert [e["epsilon"] for e in rounds] == pytest.approx([r["epsilon_a1_user_level"] for r in first])
        assert all(e["epsilon_local"] > 0 and "masked" in e["left"] for e in rounds)
        shown = result["shown"][folder.name]
        assert "round 2 of 127.0.0.1:" in shown and f"epsilon {rounds[1]['epsilon']:.4g}" in shown
        # the server told the outcome when the federation ended: released, not "if released"
        assert shown.count("round released") == 2 and "if this round is released" not in shown
    # the MLflow runs: ended, tagged, with their run config; `flwr log` ends with the epsilons
    for run in runs:
        tags = run.data.tags
        assert run.info.status == "FINISHED" and tags["register"] == REGISTER and tags["version"]
        assert tags["federation_id"] and run.data.params["min-participants"] in ("1", "2")
    assert len({r.data.tags["federation_id"] for r in runs}) == 2
    for log, out in zip(result["run_logs"], (result["out"], result["out2"]), strict=True):
        said = [_message(line) for line in ANSI.sub("", log).splitlines()]
        # the ServerApp's own last lines, before Flower's "ServerApp finished running." and its
        # bookkeeping after it (blank INFO lines aside)
        end = next((i for i, line in enumerate(said) if "ServerApp finished running" in line), len(said))
        tail = [line for line in said[:end] if line][-4:]
        assert tail[1].startswith("epsilon A.1 user-level") and tail[2].startswith(
            "epsilon A.2 record-level"
        ), tail
        assert tail[3] == f"the aggregated adapter is in {next(out.iterdir())}", tail
    # two federations on one address: two ledgers, and the device's total adds them
    assert (
        result["shown_after"].count("spend in 127.0.0.1:") == 2
        and "total over 2 federation(s)" in (result["shown_after"])
    )
    # the revoked device left (exit 0, saying why), took no part in the next federation and is not counted
    assert result["revoked_exit"] == 0
    revoked = result["a1"][1]
    assert "leaving the federation: consent was revoked" in result["logs"][revoked.name]
    kinds = [e["kind"] for e in entries(revoked)]
    assert kinds == ["consent_granted", "round", "round", "outcome", "consent_revoked"]
    (second,) = _records(result["out2"])
    assert second["accepted"] and second["participants"] == 2 and second["sampled"] == 2
    assert round(second["a1_contributions_noised"]) == 1
    stayed = [e for e in entries(result["a1"][0]) if e["kind"] == "round"]
    assert len(stayed) == 3 and stayed[2]["epsilon"] == pytest.approx(second["epsilon_a1_user_level"])
    # the forgotten upload left the pool before the next federation; the device holds the answer
    (asked,) = [e for e in entries(result["a2"][0]) if e["kind"] == "deletion_answer"]
    (kept,) = [e["upload_id"] for e in entries(result["a2"][1]) if e["kind"] == "a2_upload"]
    assert len(asked["deleted"]) == 1 and result["pooled_after_forget"] == [kept]
    print(f"deployment: two rounds in {result['run_seconds']:.0f} s")
