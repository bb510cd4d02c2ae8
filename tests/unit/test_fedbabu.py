"""FedBABU (raysim.algorithms.fedbabu) in process: the head stays at its initialization in every global model and
every upload is the body alone; a round is a fine-tuning of the received model (the PM) and then the body's
training with the head frozen; the server averages the bodies by n_i; no fine-tuning scores the received GM."""

from __future__ import annotations

import numpy as np

from raysim.algorithms.interface import payload_bytes
from raysim.algorithms.requests import LocalSGD
from raysim.execution.drivers import run_client_step
from tests.support.split_models import check_round, simulate


def test_the_head_never_moves_and_only_the_body_travels():
    sim, expected = check_round({"name": "fedbabu", "finetune_epochs": 1}, [1, 2, 4])
    algorithm = sim.host.algorithm
    gm, init = sim.coordinator.global_model(), sim.problem.init_params
    np.testing.assert_array_equal(gm[algorithm.head], init[algorithm.head])
    assert np.linalg.norm(gm[algorithm.body] - init[algorithm.body]) > 1e-2
    body = int(algorithm.body.sum())
    for update in expected:
        assert update.upload.weighted.shape == (body,)
        assert algorithm.uplink_bytes(update.upload) == payload_bytes(update.upload) == 4 * (body + 1)
    assert algorithm.downlink_bytes(sim.coordinator.broadcast()) == 4 * body
    weights = np.array([u.upload.weight for u in expected])
    assert list(weights) == [float(sim.host.info[c].num_train) for c in (1, 2, 4)]
    np.testing.assert_allclose(gm[algorithm.body], sum(u.upload.weighted for u in expected) / weights.sum(), atol=1e-6)


def test_a_round_fine_tunes_the_received_model_then_trains_the_body_with_the_head_frozen():
    sim = simulate({"name": "fedbabu", "epochs": 2, "finetune_epochs": 3}, rounds=1)
    algorithm, host = sim.host.algorithm, sim.host
    requests, results = [], []
    execute = host.steps.client_executor(0, 1)

    def run(request: LocalSGD):
        requests.append(request)
        results.append(execute(request))
        return results[-1]

    received = sim.coordinator.broadcast()
    update = run_client_step(algorithm, host.info[0], sim.states[0], received, run)
    finetune, body = requests
    assert finetune.mask is None and finetune.epochs == 3
    assert body.epochs == 2 and np.array_equal(body.mask, algorithm.body)
    np.testing.assert_array_equal(finetune.start, received)
    np.testing.assert_array_equal(body.start, received)
    np.testing.assert_array_equal(update.state.personal, results[0].params)
    body_sent = update.upload.weighted / update.upload.weight  # n_i x / n_i: float32 rounding
    np.testing.assert_allclose(body_sent, results[1].params[algorithm.body], rtol=1e-6)


def test_without_fine_tuning_the_pm_is_the_received_global_model():
    sim = simulate({"name": "fedbabu", "finetune_epochs": 0}, rounds=2, clients={"count": 5, "per_round": 5})
    first = simulate({"name": "fedbabu", "finetune_epochs": 0}, rounds=1, clients={"count": 5, "per_round": 5})
    for client in range(5):
        np.testing.assert_array_equal(sim.states[client].personal, first.coordinator.global_model())
