"""The contributor side: one Flower client per node.

A node is either a player's device (A.1: its examples come only from the consent filter for
tier A1_federated, read from the device's own stores) or the server-operated A.2 client (its
examples come from the anonymised intake pool, once at least k uploads are pooled). Both train
the global adapter with local DP-SGD and return only the LoRA tensors. Nothing else about the
node leaves it in plaintext: not its contributor id, not its consent tier, not its example count.
Whether its update is a real A.1 update travels only inside the masked vector (the A.1
indicator, set by ``mods.clip_mod`` from the private ``a1-update`` note below, which the mods
strip). Only the server-operated A.2 node reports its DP-SGD step (the server runs it anyway);
that step depends on the settings only (public rate, every pooled example: see local_training),
and the server accepts no other. It tags the claim with the pool's claim key for the round and
the server's nonce (``wire.a2_claim``): the server accounts no untagged claim, so no other node
can make it count an A.2 step, and the A.2 node trains only for a server that names that key in
the round's instructions (one started with its pool, which wrote the key): never unaccounted.

A device takes part only while its consent says A1_federated and is not revoked
(``consent.takes_part``): otherwise it refuses the round (it trains nothing and sends no
update, SecAgg+ recovers its masks, and it is not counted) and notes the refusal in its
contributions log; ``mods.refusal_mod`` turns the :class:`Refused` into an error reply that says
only :data:`REFUSAL` and one log line, not a traceback. After each round it trained in, it logs
what left it (the masked update) and what it cost: its local record-level epsilon and the
federation's user-level epsilon, computed from the mechanism the server announces in the fit
config (:data:`A1_MECHANISM`) with the ledger's accountant (``privacy.accounting.epsilon``),
keyed by the federation's id (:data:`FEDERATION_ID`, the server's ledger's; not the SuperLink's
address) with what the server says of its earlier rounds (released or not); when the federation
ends the server's outcome arrives as an evaluate message (:meth:`Contributor.evaluate`, answered
empty) and goes into the log too, so no released round stays "if released".
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.client import NumPyClient

from nimmer_train.config.federated import A2Config, UserDPConfig, dashed
from nimmer_train.errors import NimmerError
from nimmer_train.federation.wire import A1_RELEASED, A1_UPDATE, A2_KEY_ID, A2_NONCE, a2_claim, a2_key_id
from nimmer_train.memory import contributions
from nimmer_train.memory.consent import (
    ConsentRecord,
    contributor_id,
    get_consent,
    note_device_contribution,
    read_profile,
    takes_part,
    training_examples,
)
from nimmer_train.memory.embedding import NoEmbedder
from nimmer_train.memory.player_memory import PlayerMemory
from nimmer_train.privacy.a2_pool import A2Pool, PoolTooSmall, claim_key

log = logging.getLogger(__name__)
TIER = "A1_federated"
DEVICE_ACCOUNTANT = "federated_accountant.json"  # beside the device's stores
POOL_ACCOUNTANT = "a2_accountant.json"  # beside the A.2 pool
# fit-config keys of the server's user-level mechanism: its noise multiplier z, the Poisson rate
# q at which nodes are sampled, and how many rounds the ledger has released before this one
A1_MECHANISM = (
    f"{UserDPConfig.KEY}.{dashed('noise_multiplier')}",
    f"{UserDPConfig.KEY}.{dashed('fraction_fit')}",
    A1_RELEASED,
)
# fit-config keys of the federation (and of the outcome message the server sends when it ends):
# its id (made with the server's privacy ledger: the device keys its spend by it, never by the
# SuperLink's address, which two federations may share), the last round done before this one,
# and the rounds done but not released (JSON list)
FEDERATION_ID = "federation-id"
ROUNDS_DONE = "rounds-done"
NOT_RELEASED = "rounds-not-released"
OUTCOME = "federation-outcome"  # an evaluate message carrying this key: the federation has ended
OUTCOME_EPSILON = "epsilon-a1-user-level"  # in it: the federation's final user-level epsilon
REFUSAL = "this device takes no part in federated rounds"  # all a refusal tells the server
LEFT_A1 = "only the update, clipped and masked by SecAgg+ (the server sees nothing but the sum)"


class Refused(NimmerError):
    """A device that takes no part refuses the round (its text is :data:`REFUSAL`, nothing more)."""


@dataclass(frozen=True)
class Node:
    """What one node holds: the published base and register adapter, and its data."""

    base_dir: Path
    adapter_dir: Path
    device: Path | None = None  # a player's device folder (A.1)
    a2_pool: Path | None = None  # the A.2 intake (the server-operated client)
    federation: str = "unnamed"  # the SuperLink the device joined (its address), for people to read

    def __post_init__(self) -> None:
        if (self.device is None) == (self.a2_pool is None):
            raise NimmerError(
                "a node holds either a player's device (device=...) or the A.2 pool (a2-pool=...)"
            )

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> Node:
        """A SuperNode's ``--node-config "base-dir='...' adapter-dir='...' device='...'"``."""
        missing = [k for k in ("base-dir", "adapter-dir") if k not in node_config]
        if missing:
            raise NimmerError(
                f"node config lacks {', '.join(missing)}; see README 'Contribute as a federated client'"
            )
        return cls(
            Path(str(node_config["base-dir"])),
            Path(str(node_config["adapter-dir"])),
            Path(str(node_config["device"])) if "device" in node_config else None,
            Path(str(node_config["a2-pool"])) if "a2-pool" in node_config else None,
            str(node_config.get("federation", "unnamed")),
        )


def example_text(example: dict[str, str]) -> str:
    """One shared memory entry as a training line: who spoke, and what."""
    return f"{example['speaker']}: {example['text']}"


def device_examples(device: Path) -> tuple[list[str], str | None]:
    """The device's shareable examples for A.1 (through the consent filter) and its contributor id
    (None unless the device takes part in A.1: consented and not revoked)."""
    player_id, player_name = read_profile(device)
    memory = PlayerMemory(device, NoEmbedder())
    try:
        examples = training_examples(memory, TIER, player_id, player_name)
        ident = contributor_id(memory) if takes_part(get_consent(memory), TIER) is None else None
    finally:
        memory.close()
    return [example_text(e) for e in examples], ident


def device_consent(device: Path) -> ConsentRecord:
    memory = PlayerMemory(device, NoEmbedder())
    try:
        return get_consent(memory)
    finally:
        memory.close()


def federation_epsilon(config: dict[str, Any]) -> float | None:
    """The federation's user-level epsilon once this round is released: the ledger's A.1 figure,
    one accountant step (z, q) per released round. It bounds this device's loss too (it counts
    rounds released before the device joined). None when the server does not say its mechanism."""
    from nimmer_train.privacy.accounting import epsilon  # opacus, so torch: only after a fit

    if not all(k in config for k in A1_MECHANISM):
        return None
    z, q, released = (config[k] for k in A1_MECHANISM)
    return epsilon([(float(z), float(q), int(released) + 1)], float(config["delta"]))


def told_outcome(config: dict[str, Any]) -> dict[str, Any] | None:
    """What the server said of its earlier rounds: the last one done and those not released
    (None when it said nothing: a server from before release states)."""
    if ROUNDS_DONE not in config:
        return None
    try:
        not_released = [int(r) for r in json.loads(str(config.get(NOT_RELEASED) or "[]"))]
    except (ValueError, TypeError):
        return None
    return {"rounds_done": int(config[ROUNDS_DONE]), "not_released": not_released}


def pool_examples(pool_path: Path, k: int) -> list[str]:
    pool = A2Pool(pool_path, k)
    try:
        return [example_text(e) for e in pool.training_examples()]
    except PoolTooSmall as exc:
        log.warning("A.2 client trains nothing this round: %s", exc)
        return []
    finally:
        pool.close()


def a2_node_key(pool: Path, config: dict[str, Any]) -> bytes:
    """The pool's claim key, if this round's server checks claims with it; else NimmerError
    (the A.2 node trains nothing: its run would enter the sum without being accounted)."""
    key = claim_key(pool)  # missing: no server was started with this pool
    if config.get(A2_KEY_ID) != a2_key_id(key) or A2_NONCE not in config:
        raise NimmerError(
            f"this server does not account the A.2 pool {pool} (its run config a2-pool names another "
            "pool or none): the A.2 node trains nothing; start the server with a2-pool set to this pool"
        )
    return key


class Contributor(NumPyClient):
    """fit(): global adapter in, locally DP-trained adapter out."""

    def __init__(self, node: Node, crash_rounds: frozenset[int] = frozenset()) -> None:
        self.node = node
        self.crash_rounds = crash_rounds  # simulation drills: rounds in which this node fails

    def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[list[np.ndarray], int, dict]:
        from nimmer_train.federation.local_training import (  # torch: only to train
            LocalTrainingConfig,
            train_locally,
        )

        server_round = int(config["round"])
        if server_round in self.crash_rounds:
            raise RuntimeError(f"drill: this node fails in round {server_round}")
        settings = LocalTrainingConfig.from_fit_config(config, pool=self.node.a2_pool is not None)
        key = None
        if self.node.a2_pool is not None:
            key = a2_node_key(self.node.a2_pool, config)
            texts = pool_examples(self.node.a2_pool, A2Config.from_fit_config(config).k)
            accountant = self.node.a2_pool.parent / POOL_ACCOUNTANT
        else:
            assert self.node.device is not None
            self._refuse_unless_taking_part(self.node.device, server_round, config)
            texts, _ = device_examples(self.node.device)
            accountant = self.node.device / DEVICE_ACCOUNTANT
        result = train_locally(
            self.node.base_dir,
            self.node.adapter_dir,
            parameters,
            texts,
            settings,
            accountant,
            float(config["delta"]),
            str(config["spec-digest"]),
        )
        metrics: dict[str, Any] = {}
        if self.node.device is not None:  # consent revoked while it trained: the update stays here
            self._refuse_unless_taking_part(self.node.device, server_round, config)
            contributions.record(
                self.node.device,
                "round",
                **self._federation(config),
                round=server_round,
                tier=TIER,
                left=LEFT_A1,
                examples_used=result.examples,
                epsilon=federation_epsilon(config),
                epsilon_local=result.epsilon,
                delta=float(config["delta"]),
                outcome=told_outcome(config),
            )
            note_device_contribution(self.node.device)  # the consent record's count and date
        if self.node.device is not None and result.steps:  # a real A.1 update: for clip_mod only
            metrics[A1_UPDATE] = 1
        if key is not None and result.steps:  # the server operates this client: it may say how
            step = (settings.dp.noise_multiplier, result.sample_rate, result.steps)
            metrics.update(a2_claim(key, server_round, str(config[A2_NONCE]), step))
        return result.arrays, result.examples, metrics

    def evaluate(self, parameters: list[np.ndarray], config: dict[str, Any]) -> tuple[float, int, dict]:
        """Not an evaluation: the server's word, when the federation ends, on which rounds it
        released and its final epsilon, kept in a device's contributions log (nothing is sent
        back: an empty reply)."""
        if self.node.device is not None and OUTCOME in config:
            told = told_outcome(config) or {}
            epsilon = config.get(OUTCOME_EPSILON)
            contributions.record(
                self.node.device,
                "outcome",
                **self._federation(config),
                **told,
                final=True,
                epsilon=float(epsilon) if epsilon not in (None, "") else None,
                delta=float(config.get("delta", 0.0)),
            )
        return 0.0, 0, {}

    def _federation(self, config: dict[str, Any]) -> dict[str, str]:
        """The federation a log entry belongs to: the server's id and the address it was reached at."""
        ident = str(config.get(FEDERATION_ID, "") or "")
        return {"federation": self.node.federation, **({"federation_id": ident} if ident else {})}

    def _refuse_unless_taking_part(self, device: Path, server_round: int, config: dict[str, Any]) -> None:
        """A revoked or non-A.1 device refuses the round: it sends nothing and is not counted."""
        reason = takes_part(device_consent(device))
        if reason is not None:
            contributions.record(
                device, "refused", **self._federation(config), round=server_round, reason=reason
            )
            # Flower sends the exception's text to the server: the reason (the tier, when consent
            # was revoked) stays in the device's own log, the server learns only that it refused
            raise Refused(REFUSAL)
