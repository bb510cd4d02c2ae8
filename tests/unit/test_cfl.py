"""CFL (raysim.algorithms.cfl): a cluster whose clients' updates cancel while some are large splits in two along
their cosine similarities, each side moving from the model it split from by its own clients' mean update; no split
before the warm-up or for two clients; with one cluster and no split it is FedAvg with equal weights."""

from __future__ import annotations

import numpy as np

from raysim.algorithms import build_algorithm
from raysim.algorithms.cfl import CflBroadcast, CflServerState, CflSettings, bipartition
from raysim.models.spec import ParamSpec
from tests.support.split_models import simulate

SPEC = ParamSpec(("w",), ((4,),), (0,))


def _step(round_index: int, messages: dict[int, np.ndarray], clients: int = 7, warmup: int = 2):
    algorithm = build_algorithm(CflSettings(name="cfl", eps1=0.4, eps2=1.6, warmup=warmup), SPEC)
    server = CflServerState(np.ones((1, 4), np.float32), np.zeros(clients, np.int64), round_index)
    return algorithm.server_step_by_client(server, None, len(messages), messages)


def test_opposing_updates_split_the_cluster_and_each_side_moves_by_its_own_mean():
    v = np.array([2.0, 0.0, 0.0, 0.0])
    messages = {0: v, 1: 1.1 * v, 2: 0.9 * v, 3: -v, 4: -1.2 * v, 5: -0.8 * v}  # mean 0 < eps1, max 2.4 > eps2
    server, metrics = _step(5, messages)
    assert metrics["clusters"] == 2.0 and metrics["splits"] == 1.0
    assert server.cluster_of.tolist() == [0, 0, 0, 1, 1, 1, 0]  # client 6, not selected, stays with the first side
    np.testing.assert_allclose(server.models[0], 1 + np.array([2.0, 0, 0, 0]), atol=1e-6)
    np.testing.assert_allclose(server.models[1], 1 - np.array([2.0, 0, 0, 0]), atol=1e-6)
    assert server.round == 6


def test_no_split_before_the_warm_up_for_two_clients_or_while_the_mean_update_is_large():
    v = np.array([2.0, 0.0, 0.0, 0.0])
    opposing = {0: v, 1: v, 2: v, 3: -v, 4: -v, 5: -v}
    assert _step(1, opposing)[1]["clusters"] == 1.0  # warm-up
    assert _step(5, {0: v, 1: -v})[1]["clusters"] == 1.0  # two clients
    agreeing = {client: v for client in range(6)}  # the mean is as large as any: no stationary point yet
    server, metrics = _step(5, agreeing)
    assert metrics["clusters"] == 1.0
    np.testing.assert_allclose(server.models[0], 1 + v, atol=1e-6)


def test_the_bipartition_separates_updates_by_direction_whatever_their_norms():
    source = np.random.default_rng(0)
    a, b = source.normal(size=20), source.normal(size=20)
    updates = np.stack([3 * a, 0.1 * a, a + 0.01 * b, b, 5 * b])
    assert bipartition(updates).tolist() == [False, False, False, True, True]


def test_with_one_cluster_it_is_fedavg_with_equal_weights():
    cfl = simulate({"name": "cfl", "epochs": 2}, rounds=3)  # the warm-up (20 rounds) is never over
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2}, rounds=3)
    np.testing.assert_allclose(cfl.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-5)
    broadcast = cfl.coordinator.broadcast()
    assert isinstance(broadcast, CflBroadcast) and len(broadcast.models) == 1
    algorithm = cfl.host.algorithm
    assert algorithm.downlink_bytes(broadcast) == 4 * algorithm.params.size
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused
