"""Only what an epsilon covers leaves the server (issue 43): a round's exact node counts (the
review found 21 and 29 participants in ``rounds.json`` beside the published noised 19.97 and
29.92) stay in the server's private checkpoint; ``rounds.json``, the MLflow round metrics and
the round's log line hold the noised count, and the A.2 pool's exact size reaches no log line.
Each test plants distinctive exact counts and searches the outputs for them, as the planted-id
tests search for ids."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from nimmer_train.config.federated import FederatedConfig, SecAggConfig, SimulationConfig, UserDPConfig
from nimmer_train.federation import checkpoint, client, results, rounds, stage
from nimmer_train.federation.local_training import load_trainable
from nimmer_train.federation.strategy import RoundOutcome
from nimmer_train.federation.wire import AdapterSpec
from nimmer_train.privacy.a2_pool import A2Pool
from nimmer_train.privacy.accounting import Ledger
from nimmer_train.privacy.anonymize import anonymize

SETTINGS = FederatedConfig(
    min_participants=3,
    delta=1e-6,
    rounds=2,
    secagg=SecAggConfig(enabled=False),
    user_dp=UserDPConfig(fraction_fit=0.1, noise_multiplier=1.1, clipping_norm=2.0),
    simulation=SimulationConfig(contributors=199),
)  # N = 200 nodes, q N = 20
PARTICIPANTS, SAMPLED, AVAILABLE, REJECTED = 21, 47, 187, 13  # the exact figures: none may leave
EXACT = {PARTICIPANTS, SAMPLED, AVAILABLE, REJECTED, SAMPLED - PARTICIPANTS - REJECTED}
PRIVATE_KEYS = {"sampled", "available", "participants", "dropped", "rejected", "bytes_per_client"}


def _round_record() -> dict[str, Any]:
    """A released round's record as the loop builds it, with the planted exact counts."""
    loop = SimpleNamespace(settings=SETTINGS, spec=AdapterSpec(("a", "b"), ((6, 4), (9,))))
    out = RoundOutcome(sampled=SAMPLED, available=AVAILABLE, participants=PARTICIPANTS, accepted=True)
    screen = SimpleNamespace(rejected=[f"node {i}" for i in range(REJECTED)], bytes=[555_001] * PARTICIPANTS)
    record = rounds._record(loop, 1, out, screen)  # type: ignore[arg-type]
    record.update(
        accepted=True,
        a1_contributions_noised=19.97,
        heldout_loss=3.25,
        epsilon_a1_user_level=0.5,
        epsilon_a2_record_level=0.25,
        seconds=12.5,
    )
    assert {record[k] for k in ("sampled", "available", "participants", "dropped")} <= EXACT
    return record


def _numbers(value: Any) -> list[float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    if isinstance(value, list):
        return [n for v in value for n in _numbers(v)]
    return []


def _leaks(published: Any) -> list[Any]:
    """Private keys and planted exact counts found in ``published`` (a record or a list of them)."""
    records = published if isinstance(published, list) else [published]
    keys = [k for r in records for k in r if k in PRIVATE_KEYS]
    return keys + [n for n in _numbers(published) if n in EXACT or n == 555_001]


def test_the_round_report_and_log_line_hold_only_noised_counts(caplog: pytest.LogCaptureFixture) -> None:
    record = _round_record()
    reported: list[dict[str, Any]] = []
    with caplog.at_level(logging.INFO, logger="nimmer_train.federation.rounds"):
        rounds._announce(record, SETTINGS, reported.append)
    (public,) = reported
    assert _leaks(public) == [] and _leaks(stage._round_metrics(public)) == []  # what MLflow gets
    assert public["a1_contributions_noised"] == 19.97 and public["population"] == 200
    (line,) = [r.getMessage() for r in caplog.records]
    assert "a1_contributions_noised=19.97" in line
    assert not re.search(rf"(?<![\d.])({'|'.join(map(str, EXACT))})(?![\d.])", line), line
    assert not {"participants", "dropped", "sampled"} & set(re.findall(r"(\w+)=", line))


def test_rounds_json_holds_only_noised_counts_and_the_checkpoint_keeps_the_exact_ones(
    release: tuple[Path, Path], tmp_path: Path
) -> None:
    base, adapter = release
    ledger = Ledger(SETTINGS.delta)
    ledger.record((1.1, 0.1, 1), [])
    state = checkpoint.ServerState(
        round=1, stopped="completed", records=[_round_record()], ledger=json.loads(json.dumps(vars(ledger)))
    )
    (tmp_path / "server").mkdir()
    state.save(tmp_path / "server", [])
    model = load_trainable(base, adapter)[0]
    out = tmp_path / "out"
    results.publish_federated(out, model, adapter, "f" * 64, SETTINGS, state)
    published = json.loads((out / results.ROUNDS).read_text())
    assert _leaks(published) == [] and published[0]["a1_contributions_noised"] == 19.97
    for name in (results.CONTRIBUTED, "nimmer_adapter.json"):
        assert not PRIVATE_KEYS & set(re.findall(r'"(\w+)":', (out / name).read_text()))
    # the server's own checkpoint keeps them (it resumes from it; it is never published)
    (kept,) = checkpoint.ServerState.load(tmp_path / "server").records
    assert kept["participants"] == PARTICIPANTS and kept["sampled"] == SAMPLED


def test_the_a2_node_logs_no_exact_pool_size(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    pool = A2Pool(tmp_path / "a2.sqlite", k=9)
    for i in range(7):  # 7 < k = 9: the node trains nothing, and says so without the 7
        pool.add(anonymize([{"text": f"line {i}"}], f"p{i}", f"name{i}"))
    pool.close()
    with caplog.at_level(logging.INFO):
        assert client.pool_examples(tmp_path / "a2.sqlite", 9) == []
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "trains nothing" in text and not re.search(r"\b7\b", text), text
