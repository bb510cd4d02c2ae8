"""The Ray runtime: invariants on live actor state, packing determinism, state of unselected clients."""

from __future__ import annotations

import numpy as np
import pytest

from raysim.config import RuntimeSettings, validate_config
from raysim.errors import ConfigError
from raysim.runtime.placement import check_capacity, default_num_hosts
from tests.support.experiments import tiny_config


def test_bernoulli_sampling_draws_each_client_with_probability_s_over_m_and_never_nobody():
    """clients.sampling = bernoulli (FedSLR's authors' code): |S^t| varies with mean s at m = 100, s = 10; at m = 3,
    s = 1 an empty draw (probability (2/3)^3) is drawn again, so the mean size is 1 / (1 - (2/3)^3) = 1.42, not 1;
    the same seed and round give the same set, and uniform sampling is unchanged."""
    from raysim.runtime.problem import sample_clients

    sizes = [len(sample_clients(1, t, 100, 10, "bernoulli")) for t in range(2000)]
    assert np.mean(sizes) == pytest.approx(10.0, abs=0.5) and len(set(sizes)) > 5
    small = [sample_clients(2, t, 3, 1, "bernoulli") for t in range(3000)]
    assert min(map(len, small)) >= 1
    assert np.mean([len(s) for s in small]) == pytest.approx(1 / (1 - (2 / 3) ** 3), abs=0.06)
    assert sample_clients(3, 7, 100, 10, "bernoulli") == sample_clients(3, 7, 100, 10, "bernoulli")
    assert sample_clients(3, 7, 100, 10) == sample_clients(3, 7, 100, 10, "uniform")
    assert len(sample_clients(3, 7, 100, 10)) == 10
    with pytest.raises(ConfigError, match=r"clients\.sampling.*'uniform'.*'bernoulli'"):
        validate_config(tiny_config(clients={"count": 6, "per_round": 2, "sampling": "poisson"}))


def test_simulated_network_time_is_latency_plus_bytes_over_bandwidth():
    """config.network: a shared link moves all clients' bytes one after another, per-client links in parallel (the
    largest transfer); no bandwidth, no time."""
    from raysim.config import NetworkSettings

    shared = NetworkSettings(bandwidth_mbps=8.0, latency_ms=20.0)
    assert shared.seconds([1e6, 3e6]) == pytest.approx(0.020 + 4.0)  # 4 MB = 32 Mbit at 8 Mbit/s
    assert NetworkSettings(bandwidth_mbps=8.0, latency_ms=20.0, link="per_client").seconds([1e6, 3e6]) == (
        pytest.approx(0.020 + 3.0)
    )
    assert NetworkSettings().seconds([1e6]) == 0.0 and shared.seconds([]) == 0.0
    with pytest.raises(ConfigError, match=r"network\.bandwidth_mbps"):
        validate_config(tiny_config(network={"bandwidth_mbps": 0}))


@pytest.mark.parametrize(
    "settings, available, hosts",
    [
        ({}, {"CPU": 16.0, "GPU": 1.0}, 16),
        ({"host_cpus": 0.5}, {"CPU": 3.0}, 6),
        ({"host_gpus": 0.25}, {"CPU": 16.0, "GPU": 1.0}, 4),  # the GPU, not the 16 CPUs, bounds the hosts
        ({"host_gpus": 0.3}, {"CPU": 16.0, "GPU": 1.0}, 3),
        ({"host_gpus": 0.25, "coordinator_gpus": 0.5}, {"CPU": 16.0, "GPU": 1.0}, 2),
        ({"host_gpus": 0.5, "host_cpus": 4.0}, {"CPU": 4.0, "GPU": 2.0}, 1),
        ({"host_gpus": 1.0}, {"CPU": 2.0}, 1),  # none fits: one, which check_capacity then refuses
    ],
)
def test_default_host_count_fits_the_free_cpus_and_gpus(settings, available, hosts):
    assert default_num_hosts(RuntimeSettings(**settings), available) == hosts


def test_capacity_errors_name_the_key_and_the_shortfall():
    check_capacity(RuntimeSettings(host_gpus=0.25), 4, {"CPU": 4.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"runtime.host_gpus=0.25 .* needs 1.25 GPUs but the Ray cluster has 1"):
        check_capacity(RuntimeSettings(host_gpus=0.25, coordinator_gpus=0.25), 4, {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(ConfigError, match=r"runtime.host_cpus=1 .* needs 3 CPUs but the Ray cluster has 2"):
        check_capacity(RuntimeSettings(coordinator_cpus=1.0), 2, {"CPU": 2.0})
