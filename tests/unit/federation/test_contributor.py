"""The contributor's device in a round: a revoked or opt-out device refuses the round (nothing is
trained or sent, the refusal is logged), and a taking-part device logs each round with the
federation's epsilon equal to the server ledger's (the fit config the server's own strategy
builds, and the ledger's own accounting) and its local DP-SGD epsilon equal to its accountant's.
Real parts: a tiny signed release, real Opacus training, the server's NoisyMean and Ledger."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nimmer_train.config.federated import FederatedConfig, LocalRecipeConfig, UserDPConfig
from nimmer_train.errors import NimmerError
from nimmer_train.federation.client import DEVICE_ACCOUNTANT, Contributor, Node, federation_epsilon
from nimmer_train.federation.local_training import load_trainable
from nimmer_train.federation.strategy import NoisyMean, fit_config
from nimmer_train.federation.wire import get_arrays, spec_of
from nimmer_train.memory.consent import revoke
from nimmer_train.memory.contributions import entries
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.memory.synthetic import generate_player
from nimmer_train.privacy.accounting import Ledger, epsilon
from nimmer_train.publish.signing import Keyring
from nimmer_train.publish.versions import open_version
from tests.helpers.memory import HashEmbedder
from tests.helpers.published import publish_registers

SETTINGS = FederatedConfig(
    rounds=2,
    user_dp=UserDPConfig(noise_multiplier=0.8, fraction_fit=0.5),
    local=LocalRecipeConfig(steps=2, batch_size=4),
)


@pytest.fixture(scope="module")
def release(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(base folder, register adapter folder) of a signed tiny v1 with one register LoRA."""
    releases, trusted = publish_registers(tmp_path_factory.mktemp("release"), ("caste-preacher",))
    version = open_version(releases, "v1", Keyring.load(trusted))
    return version.folder, version.loras["caste-preacher"]


def _device(folder: Path, tier: str) -> Path:
    generate_player(folder, HashEmbedder(), seed=7, entries=60, player_id="player-4c1d", tier=tier)
    return folder


def _configs(release: tuple[Path, Path], released: list[int]) -> tuple[list, NoisyMean]:
    """The global arrays, and the server's strategy whose fit config says how many rounds the
    ledger has released (``released[0]``)."""
    model = load_trainable(*release)[0]
    spec = spec_of(model)
    strategy = NoisyMean(SETTINGS, spec, fit_config(SETTINGS, spec), released=lambda: released[0])
    return get_arrays(model), strategy


def test_device_logs_each_round_with_the_ledgers_epsilon(release: tuple[Path, Path], tmp_path: Path) -> None:
    device = _device(tmp_path / "me", "A1_federated")
    arrays, strategy = _configs(release, released := [0])
    client = Contributor(Node(*release, device=device, federation="fl.example:8000"))
    ledger = Ledger(SETTINGS.delta)
    for server_round in (1, 2):
        config = strategy.strategy.on_fit_config_fn(server_round)  # what the server sends
        trained, examples, _ = client.fit(arrays, config)
        assert examples > 0 and any((a != b).any() for a, b in zip(trained, arrays, strict=True))
        ledger.record(
            (SETTINGS.user_dp.noise_multiplier, SETTINGS.user_dp.fraction_fit, 1)
        )  # the server releases it
        released[0] = len(ledger.a1)
    rounds = [e for e in entries(device) if e["kind"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2]
    assert [e["epsilon"] for e in rounds] == pytest.approx(
        [r["epsilon_a1_user_level"] for r in ledger.rounds]
    )
    assert rounds[-1]["epsilon"] == pytest.approx(epsilon([(0.8, 0.5, 2)], SETTINGS.delta))
    history = [tuple(h) for h in json.loads((device / DEVICE_ACCOUNTANT).read_text())["history"]]
    assert rounds[-1]["epsilon_local"] == pytest.approx(epsilon(history, SETTINGS.delta))
    assert rounds[-1]["federation"] == "fl.example:8000" and rounds[-1]["tier"] == "A1_federated"
    assert "masked" in rounds[-1]["left"] and rounds[-1]["delta"] == SETTINGS.delta
    # without the mechanism in the fit config a device cannot say what the round cost
    assert federation_epsilon({"delta": 1e-5}) is None


@pytest.mark.parametrize("tier", ["revoked", "opt_out", "A2_anonymized"])
def test_a_device_that_takes_no_part_refuses_the_round(
    release: tuple[Path, Path], tmp_path: Path, tier: str
) -> None:
    device = _device(tmp_path / "me", "A1_federated" if tier == "revoked" else tier)
    if tier == "revoked":
        memory = PlayerMemory(device, HashEmbedder())
        revoke(memory)
        memory.close()
    arrays, strategy = _configs(release, [0])
    client = Contributor(Node(*release, device=device, federation="fl.example:8000"))
    with pytest.raises(NimmerError, match="takes no part in federated rounds"):
        client.fit(arrays, strategy.strategy.on_fit_config_fn(1))
    (refused,) = [e for e in entries(device) if e["kind"] == "refused"]  # after the revocation's own line
    assert refused["kind"] == "refused" and refused["round"] == 1
    assert ("revoked" if tier == "revoked" else tier) in refused["reason"]
    assert not (device / DEVICE_ACCOUNTANT).exists()  # nothing was trained, nothing accounted
