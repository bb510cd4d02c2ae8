"""q-FFL (raysim.algorithms.qffl) in process: q = 0 is FedAvg with equal weights; a round's step is Algorithm 2
written out from the clients' losses at the received model and their local models (client k's share of the step
grows as F_k^q); its fairness claim on raysim's own fairness metrics: tests/integration/test_fairness.py."""

from __future__ import annotations

import numpy as np
import pytest

from tests.support.split_models import simulate, step_results


def test_q_zero_is_fedavg_with_equal_weights():
    qffl = simulate({"name": "qffl", "q": 0.0, "epochs": 2}, rounds=3)
    fedavg = simulate({"name": "fedavg", "aggregation": "uniform", "epochs": 2}, rounds=3)
    np.testing.assert_allclose(qffl.coordinator.global_model(), fedavg.coordinator.global_model(), atol=1e-5)
    assert np.linalg.norm(qffl.coordinator.global_model() - qffl.problem.init_params) > 1e-2


@pytest.mark.parametrize("q", [0.5, 2.0])
def test_a_round_is_algorithm_2_written_out(q):
    """From each selected client's loss F_k at w and its local model wbar_k (recomputed with the host's executor),
    in float64: w - sum_k F_k^q L (w - wbar_k) / sum_k (q F_k^{q-1} ||L (w - wbar_k)||^2 + L F_k^q), L = 1/lr."""
    sim = simulate({"name": "qffl", "q": q, "epochs": 1}, rounds=1, clients={"count": 4, "per_round": 4})
    algorithm, w = sim.host.algorithm, sim.coordinator.broadcast()
    lipschitz, steps, hs = 1 / algorithm.settings.lr, [], []
    for client in range(4):
        (trained, at_w) = step_results(sim, client, w).results
        local, loss = np.asarray(trained.params, np.float64), at_w.loss
        change = lipschitz * (w.astype(np.float64) - local)
        steps.append(loss**q * change)
        hs.append(q * loss ** (q - 1) * change @ change + lipschitz * loss**q)
    want = w - np.sum(steps, axis=0) / np.sum(hs)
    sim.round(1)
    np.testing.assert_allclose(sim.coordinator.global_model(), want, rtol=1e-5, atol=1e-6)
