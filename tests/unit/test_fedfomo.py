"""FedFomo (raysim.algorithms.fedfomo): eqs. 4-6 on quadratic losses worked by hand, no positive weight keeps the
model, the server's affinity update (Algorithm 1) on hand-made messages, the top-M / epsilon-greedy choice, the
communication counts, a real round's step recomputed from its loss results, and without models it is local
training."""

from __future__ import annotations

import math

import numpy as np
import pytest

from raysim.algorithms import build_algorithm
from raysim.algorithms.fedfomo import (
    FedFomo,
    FedFomoBroadcast,
    FedFomoClientState,
    FedFomoServerState,
    FedFomoSettings,
    FedFomoUpload,
    fomo_step,
    fomo_weights,
)
from raysim.algorithms.interface import ClientInfo
from raysim.algorithms.requests import FullGradient, GradientResult, LocalSGD, SGDResult
from raysim.execution.drivers import run_client_step
from raysim.models.spec import ParamSpec
from tests.support.split_models import simulate, step_results

SPEC = ParamSpec(("w",), ((2,),), (0,))
TARGET = np.array([1.0, 0.0])
"""Client 0's optimum: its loss is L(theta) = ||theta - TARGET||^2 / 2."""
MODELS = np.array([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.5, 0.5]], np.float32)
"""Client 0's own model (row 0) and the four others'. Losses 0.5, 0, 2.5, 0.5, 0.25 at distances -, 1, 2, 2,
sqrt(1/2) from row 0: eq. 6 gives 0.5, -1, 0, sqrt(2)/4."""
RAW = np.array([0.5, -1.0, 0.0, math.sqrt(2) / 4])


def _algorithm(**settings) -> FedFomo:
    algorithm = build_algorithm(FedFomoSettings(name="fedfomo", **settings), SPEC)
    assert isinstance(algorithm, FedFomo)
    return algorithm


def _quadratic_step(algorithm: FedFomo, models: np.ndarray, chosen: list[int], state=None):
    """Client 0's step on the quadratic loss (from `state`, else one holding row 0), local training the identity (its
    upload is eq. 4's model); returns the update and the requests."""
    requests: list = []

    def execute(request):
        requests.append(request)
        if isinstance(request, FullGradient):
            difference = np.asarray(request.point, np.float64) - TARGET
            return GradientResult(difference.astype(np.float32), 0.5 * float(difference @ difference))
        assert isinstance(request, LocalSGD)
        return SGDResult(request.start, mean_loss=0.0, steps=1)

    broadcast = FedFomoBroadcast(models, np.array([chosen] + [[-1] * len(chosen)] * 4))
    state = algorithm.init_client(ClientInfo(0, 10, 0.2, 5), models[0]) if state is None else state
    return run_client_step(algorithm, ClientInfo(0, 10, 0.2, 5), state, broadcast, execute), requests


def test_eqs_4_to_6_on_quadratic_losses():
    update, requests = _quadratic_step(_algorithm(num_models=4), MODELS, [1, 2, 3, 4])
    total = 0.5 + math.sqrt(2) / 4
    weights = np.array([0.5 / total, 0.0, 0.0, math.sqrt(2) / 4 / total])  # the positive ones, summing to 1
    expected = weights @ MODELS[1:]  # theta_0 = 0: eq. 4 is the weighted average
    np.testing.assert_allclose(update.state.personal, expected, atol=1e-6)
    np.testing.assert_allclose(update.upload.weights, [0.0, *weights], atol=1e-7)  # what P[0, :] gains
    assert [r.split for r in requests[:-1]] == ["val"] * 5  # own model first, then the four received
    np.testing.assert_array_equal(requests[0].point, MODELS[0])
    assert update.metrics["base_loss"] == pytest.approx(0.5)
    assert update.metrics["positive_weights"] == 2.0 and update.metrics["weighed_models"] == 4.0
    new_loss = 0.5 * float((expected - TARGET) @ (expected - TARGET))
    assert new_loss < 0.5  # eq. 4 lowers the client's loss
    raw, _ = _quadratic_step(_algorithm(num_models=4, affinity="raw", split="train"), MODELS, [1, 2, 3, 4])
    np.testing.assert_allclose(raw.upload.weights, [0.0, *RAW], atol=1e-6)  # signed, before clipping
    np.testing.assert_allclose(raw.state.personal, expected, atol=1e-6)  # the same step


def test_the_codes_baseline_weighs_the_trained_model_against_the_one_training_started_from():
    """baseline start: L at the start (0, 0) is 0.5; the trained (0.5, 0) has 0.125 at distance 0.5 (w = 0.75), model 1
    (1, 0) has 0 at distance 1 (w = 0.5), model 2 is worse: weights 0.6 and 0.4 (P[0, 0] and P[0, 1])."""
    state = FedFomoClientState(np.array([0.5, 0.0], np.float32), np.zeros(2, np.float32))
    update, requests = _quadratic_step(_algorithm(num_models=2, baseline="start"), MODELS, [1, 2], state)
    np.testing.assert_array_equal(requests[0].point, state.start)
    np.testing.assert_allclose(update.upload.weights, [0.6, 0.4, 0.0, 0.0, 0.0], atol=1e-6)
    np.testing.assert_allclose(update.state.personal, [0.7, 0.0], atol=1e-6)
    np.testing.assert_allclose(update.state.start, [0.7, 0.0], atol=1e-6)  # where this round's training started
    assert update.metrics["weighed_models"] == 3.0


def test_eq_4_from_a_model_of_its_own_steps_along_the_differences():
    own = np.array([0.5, -0.5], np.float32)
    models = np.array([[2.0, 1.0], [0.0, 0.0]], np.float32)
    weights = np.array([0.25, 0.75])
    expected = own + 0.25 * (models[0] - own) + 0.75 * (models[1] - own)
    np.testing.assert_allclose(fomo_step(own, models, weights), expected, atol=1e-7)
    np.testing.assert_allclose(fomo_weights(np.array([-2.0, 1.0, 3.0])), [0.0, 0.25, 0.75])
    np.testing.assert_array_equal(fomo_weights(np.array([-2.0, 0.0])), [0.0, 0.0])


def test_without_a_positive_weight_the_client_trains_its_own_model():
    worse = MODELS.copy()
    worse[0] = TARGET  # client 0 holds its optimum: every other model is worse
    update, requests = _quadratic_step(_algorithm(num_models=4), worse, [1, 2, 3, 4])
    np.testing.assert_array_equal(requests[-1].start, worse[0])
    np.testing.assert_array_equal(update.upload.weights, np.zeros(5))
    assert update.metrics["fomo_step"] == 0.0 and update.metrics["positive_weights"] == 0.0


def _server(m: int = 4, n: int = 3) -> FedFomoServerState:
    return _algorithm().init_server(np.zeros(n, np.float32), m)


def test_the_server_stores_the_models_and_adds_the_weights_to_the_senders_rows():
    algorithm = _algorithm()
    server = _server()
    server.affinity[1] = [0.0, 0.0, 0.5, 0.5]
    messages = {
        1: np.array([1.0, 2.0, 3.0, 0.0, 0.0, 0.25, 0.75, 30.0]),  # theta_1, its weights row, n_1
        3: np.array([-1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 10.0]),
    }
    new, metrics = algorithm.server_step_by_client(server, None, 2, messages)
    np.testing.assert_allclose(new.affinity[1], [0.0, 0.0, 0.75, 1.25])  # P[i, n] += w_n
    np.testing.assert_allclose(new.affinity[3], [1.0, 0.0, 0.0, 0.0])
    np.testing.assert_array_equal(new.affinity[[0, 2]], 0.0)
    np.testing.assert_array_equal(new.models[[0, 2]], 0.0)  # unselected clients keep their models
    np.testing.assert_allclose(new.models[1], [1.0, 2.0, 3.0])
    assert new.uploaded.tolist() == [False, True, False, True] == new.last_round.tolist()
    assert new.round == 1 and new.samples.tolist() == [0.0, 30.0, 0.0, 10.0]
    np.testing.assert_allclose(algorithm.global_model(new), [0.5, 1.5, 2.5])  # (30 theta_1 + 10 theta_3) / 40
    assert metrics["uploaded_clients"] == 2.0
    later, _ = algorithm.server_step_by_client(new, None, 1, {0: np.array([0.0, 0.0, 0.0, 0, 1, 0, 0, 20.0])})
    assert later.uploaded.tolist() == [True, True, False, True] and later.last_round.tolist() == [True] + [False] * 3
    np.testing.assert_allclose(algorithm.global_model(later), [20 / 60, 1.0, 100 / 60], atol=1e-6)
    np.testing.assert_array_equal(algorithm.global_model(server), np.zeros(3))  # no upload: the initial model


def test_the_top_m_by_affinity_among_the_candidates_and_epsilon_greedy_exploration():
    server = _server(m=6)
    server.uploaded[:] = [True, True, True, True, False, True]
    server.last_round[:] = [False, True, True, False, False, False]
    server.affinity[0] = [9.0, 1.0, 5.0, 3.0, 8.0, 4.0]  # its own and client 4's (never uploaded) are no candidates
    server.round = 6  # eps_6 = max(0, 0.3 - 6 0.05) = 0: greedy
    assert _algorithm(num_models=3).choose(server)[0].tolist() == [2, 5, 3]
    assert _algorithm(num_models=9).choose(server)[0].tolist() == [2, 5, 3, 1, -1, -1, -1, -1, -1]
    assert _algorithm(num_models=3, candidates="last_round").choose(server)[0].tolist() == [2, 1, -1]
    assert (_algorithm(num_models=0).choose(server) == -1).all()
    exploring = _algorithm(num_models=3, epsilon=1.0, epsilon_decay=0.0)
    draws = {tuple(exploring.choose(_server_at(server, r))[0]) for r in range(40)}
    assert len(draws) > 1 and all(len(set(d)) == 3 and set(d) <= {1, 2, 3, 5} for d in draws)
    np.testing.assert_array_equal(exploring.choose(server), exploring.choose(server))  # the same on every host


def _server_at(server: FedFomoServerState, round_index: int) -> FedFomoServerState:
    return FedFomoServerState(
        server.models, server.affinity, server.samples, server.uploaded, server.last_round, server.seed, round_index
    )


def test_communication_counts_m_models_down_and_the_model_weights_and_size_up():
    algorithm = _algorithm(num_models=2)
    server = _server(m=4, n=3)
    assert algorithm.downlink_bytes(algorithm.broadcast(server)) == 0  # nothing uploaded yet: local training
    server.uploaded[:] = True
    assert algorithm.downlink_bytes(algorithm.broadcast(server)) == 2 * 4 * 3
    upload = FedFomoUpload(np.zeros(3, np.float32), 10.0, np.zeros(4), 2.0)
    assert algorithm.uplink_bytes(upload) == 4 * 3 + 4 + 4 * 2
    assert not algorithm.Upload.carries_message()  # attacks and robust rules are refused


def test_a_round_on_a_validation_split_takes_eq_4_from_its_loss_results():
    partition = {"scheme": "dirichlet", "beta": 0.5, "val_fraction": 0.2}
    sim = simulate({"name": "fedfomo", "num_models": 2, "epsilon": 0.0}, rounds=2, partition=partition)
    broadcast = sim.coordinator.broadcast()
    client = int(np.flatnonzero((broadcast.chosen >= 0).all(axis=1))[0])
    own = sim.states[client].personal
    recorded = step_results(sim, client, broadcast)
    *losses, training = recorded.requests
    assert [r.split for r in losses] == ["val"] * 3 and isinstance(training, LocalSGD)
    ids = broadcast.chosen[client]
    own_loss = recorded.results[0].loss
    raw = [
        (own_loss - result.loss) / np.linalg.norm(broadcast.models[n].astype(np.float64) - own)
        for n, result in zip(ids, recorded.results[1:3], strict=True)
    ]
    np.testing.assert_allclose(training.start, fomo_step(own, broadcast.models[ids], fomo_weights(np.array(raw))))
    row = np.zeros(5)
    row[ids] = fomo_weights(np.array(raw))
    np.testing.assert_allclose(recorded.update.upload.weights, row)
    server = sim.server
    assert server.uploaded.any() and np.isfinite(server.affinity).all()


def test_without_models_it_is_local_training():
    fomo = simulate({"name": "fedfomo", "num_models": 0, "split": "train", "epochs": 2}, rounds=3)
    local = simulate({"name": "local", "epochs": 2}, rounds=3)
    for client, state in fomo.states.items():
        np.testing.assert_array_equal(state.personal, local.states[client].theta)
    assert fomo.host.algorithm.downlink_bytes(fomo.coordinator.broadcast()) == 0
    assert not fomo.server.affinity.any()


def test_a_validation_split_the_partition_does_not_make_is_refused_before_any_work(tmp_path):
    from raysim.algorithms.interface import ServerContext
    from raysim.errors import ConfigError

    def context(val_fraction: float, partition: str = "dirichlet") -> ServerContext:
        return ServerContext(
            partition, val_fraction, (), "fashion_mnist", "mlr", (1, 28, 28), 10, "classification", 1, tmp_path
        )

    with pytest.raises(ConfigError, match=r"^algorithm.split=val: .* set partition.val_fraction"):
        _algorithm().server_data(context(0.0))
    assert _algorithm().server_data(context(0.2)) is None
    assert _algorithm(split="train").server_data(context(0.0)) is None
    assert _algorithm().server_data(context(0.0, "file")) is None  # a partition file may list validation samples
