"""SecAgg+ under the DP-FedAvg release (issue 20, item 7): n nodes' quantised values sum modulo
2^32, so a configuration or a round that could overflow is refused before it happens, naming the
bound; a contribution clipped for SecAgg+'s quantisation stays under the clipping norm after it."""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.common import ndarrays_to_parameters
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.server.client_manager import SimpleClientManager
from flwr.server.client_proxy import ClientProxy

from nimmer_train.config.federated import (
    SECAGG_MAX_NODES,
    SECAGG_MODULUS_RANGE,
    SECAGG_QUANTIZATION_RANGE,
    FederatedConfig,
    SecAggConfig,
    SimulationConfig,
    UserDPConfig,
)
from nimmer_train.errors import ConfigError
from nimmer_train.federation import rounds
from nimmer_train.federation.mods import contribution
from nimmer_train.federation.strategy import NoisyMean, fit_config
from nimmer_train.federation.wire import QUANTUM, AdapterSpec

SPEC = AdapterSpec(("a", "b"), ((6, 4), (9,)))


def test_secagg_overflow_is_refused_before_it_happens() -> None:
    """Item 7: n nodes' quantised values (each up to 2^22, and each node's weight factor 2^22)
    sum modulo 2^32: 1024 nodes wrap to 0. A configuration or a round that could reach it is
    refused with the bound named."""
    assert (SECAGG_MAX_NODES + 1) * SECAGG_QUANTIZATION_RANGE % SECAGG_MODULUS_RANGE == 0
    assert SECAGG_MAX_NODES * SECAGG_QUANTIZATION_RANGE < SECAGG_MODULUS_RANGE
    FederatedConfig(
        simulation=SimulationConfig(contributors=SECAGG_MAX_NODES - 1)
    )  # with the A.2 node: 1023 nodes, all sampled
    with pytest.raises(ConfigError, match="1023 nodes per round.*overflows"):
        FederatedConfig(simulation=SimulationConfig(contributors=SECAGG_MAX_NODES))
    # Poisson cohorts vary: an expected 1000 of 100,000 may pass 1023; 500 of them stays clear
    with pytest.raises(ConfigError, match="expected cohort of 1000"):
        FederatedConfig(
            user_dp=UserDPConfig(fraction_fit=0.01), simulation=SimulationConfig(contributors=99_999)
        )
    FederatedConfig(
        user_dp=UserDPConfig(fraction_fit=0.005), simulation=SimulationConfig(contributors=99_999)
    )
    FederatedConfig(
        secagg=SecAggConfig(enabled=False), simulation=SimulationConfig(contributors=SECAGG_MAX_NODES)
    )  # no SecAgg+: no bound

    class Proxy(ClientProxy):
        get_properties = get_parameters = fit = evaluate = reconnect = None  # type: ignore[assignment]

    manager = SimpleClientManager()
    for i in range(SECAGG_MAX_NODES + 1):
        manager.register(Proxy(str(i)))
    settings = FederatedConfig()
    strategy = NoisyMean(settings, SPEC, fit_config(settings, SPEC))
    assert strategy.configure_fit(1, ndarrays_to_parameters([]), manager) == []
    assert strategy.outcome.stop and re.search(r"1024 nodes sampled.*at most 1023", strategy.outcome.stop)


def test_secaggs_rounding_keeps_a_contribution_under_the_clipping_norm() -> None:
    """Item 7: a contribution clipped exactly to C leaves SecAgg+ (float32 quantisation with
    stochastic rounding, then dequantisation) with a norm above C about half the time; clipped to
    wire.contribution_bound it never does. Flower's own quantize/dequantize, our SecAgg+ ranges."""
    settings = FederatedConfig(user_dp=UserDPConfig(clipping_norm=10.0))
    workflow = rounds._fit_workflow(settings)
    clip_range, quant_range = workflow.clipping_range, workflow.quantization_range
    quantum = fit_config(settings, SPEC)[QUANTUM]
    assert quantum == 2 * clip_range / quant_range
    rng = np.random.default_rng()
    norms = []
    for trial in range(40):
        update = [rng.normal(size=(200, 100)), rng.normal(size=(1000,))]
        sent = contribution(update, trial % 2 == 0, settings.user_dp.clipping_norm, quantum)
        received = dequantize(quantize(sent, clip_range, quant_range), clip_range, quant_range)
        norms.append(float(np.sqrt(sum(float(np.sum(np.square(r))) for r in received))))
    assert max(norms) <= settings.user_dp.clipping_norm
    assert min(norms) > settings.user_dp.clipping_norm - 0.01  # and the margin costs nearly nothing
