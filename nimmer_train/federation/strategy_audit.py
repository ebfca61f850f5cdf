"""The user-level audit run through the aggregator the federation runs: :class:`NoisyMean`.

:mod:`nimmer_train.privacy.audit` releases its canary rounds with ``dp_fedavg.aggregate`` unless
told otherwise; an audit of that arithmetic cannot see a defect in how the server itself sums,
checks or noises a round (issue 43: one client scaling every honest update in its round). Here
each audited round goes the way a round does on the server: every sampled node's update becomes
the contribution its client sends (``mods.contribution``: clipped, with its A.1 indicator), the
replies reach ``NoisyMean.aggregate_fit`` as FitRes, and the released update is what the round
loop would adopt. SecAgg+'s masking is not run (the plain FedAvg path's float64 sum); a strategy
class may be passed to audit a variant (a test's forged weight).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from flwr.common import Code, FitRes, Status, ndarrays_to_parameters

from nimmer_train.config.federated import FederatedConfig
from nimmer_train.federation.mods import contribution
from nimmer_train.federation.strategy import NoisyMean, RoundOutcome
from nimmer_train.federation.wire import AdapterSpec
from nimmer_train.privacy.audit import ReleaseRound, UserLevelAudit, audit_user_level
from nimmer_train.privacy.dp_fedavg import Mechanism

AGGREGATOR = "federation.strategy.NoisyMean.aggregate_fit (the server's own aggregation, SecAgg+ off)"


def strategy_release(settings: FederatedConfig, strategy: type[NoisyMean] = NoisyMean) -> ReleaseRound:
    """A :data:`ReleaseRound` that releases each audited round through ``strategy`` built from
    ``settings`` with the audited mechanism's z, q and C (the z = 0 control included) and its N."""
    servers: dict[Mechanism, NoisyMean] = {}  # one per mechanism: the audit and its control
    draw: list[np.random.Generator] = []  # the audit's generator, for the strategy's noise

    def release_round(
        updates: list[np.ndarray], mechanism: Mechanism, rng: np.random.Generator
    ) -> np.ndarray | None:
        draw[:] = [rng]
        if mechanism not in servers:
            servers[mechanism] = _server(settings, strategy, mechanism, int(updates[0].size), draw)
        server = servers[mechanism]
        server.outcome = RoundOutcome(sampled=len(updates))
        server.aggregate_fit(1, [(None, _reply(u, mechanism.clip)) for u in updates], [])  # type: ignore[misc]
        if not server.outcome.accepted or server.outcome.update is None:
            return None
        return np.asarray(server.outcome.update[0], np.float64)

    return release_round


def _server(
    settings: FederatedConfig,
    strategy: type[NoisyMean],
    mechanism: Mechanism,
    dim: int,
    draw: list[np.random.Generator],
) -> NoisyMean:
    """``strategy`` for ``mechanism`` over flat updates of ``dim`` coordinates (SecAgg+ off)."""
    user_dp = dataclasses.replace(
        settings.user_dp,
        noise_multiplier=mechanism.noise_multiplier,
        fraction_fit=mechanism.sample_rate,
        clipping_norm=mechanism.clip,
    )
    run = dataclasses.replace(
        settings,
        user_dp=user_dp,
        no_privacy=mechanism.noise_multiplier == 0,  # the z = 0 control
        epsilon_budget=None,
        secagg=dataclasses.replace(settings.secagg, enabled=False),
    )
    server = strategy(run, AdapterSpec(("audit",), ((dim,),)), {}, rng=lambda: draw[0])
    server.mechanism = mechanism  # its N: the audit's population, not the settings' nodes
    return server


def _reply(update: np.ndarray, clip: float) -> FitRes:
    """What an A.1 client's reply carries for ``update`` (clipped, with its indicator)."""
    parts = contribution([np.asarray(update, np.float64)], True, clip, 0.0)
    return FitRes(Status(Code.OK, ""), ndarrays_to_parameters(parts), 1, {})


def audit_aggregator(
    settings: FederatedConfig,
    mechanism: Mechanism,
    strategy: type[NoisyMean] = NoisyMean,
    **audit: Any,
) -> UserLevelAudit:
    """:func:`audit_user_level` of ``mechanism`` as ``strategy`` releases it (``audit``: its
    canaries, dim, rng, confidence, control)."""
    name = AGGREGATOR if strategy is NoisyMean else f"{strategy.__module__}.{strategy.__qualname__}"
    return audit_user_level(
        mechanism, release_round=strategy_release(settings, strategy), aggregator=name, **audit
    )
