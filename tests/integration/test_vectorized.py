"""Vectorized client training (runtime.client_training = vectorized) against the one-client-at-a-time path:
VectorizedTrainer against LocalTrainer request by request, the lockstep driver against run_client_step, and
whole in-process runs of both modes."""

from __future__ import annotations

import numpy as np

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.experiments import tiny_config


def test_ray_hosts_train_vectorized_like_sequential(ray_local, mlflow_uri):
    """runtime.client_training reaches the host actors: a real Ray run with 2 hosts, both modes."""
    finals = {}
    for mode in ("sequential", "vectorized"):
        config = validate_config(
            tiny_config(
                clients={"count": 5, "per_round": 3},
                runtime={"num_hosts": 2, "host_cpus": 0.5, "client_training": mode},
                tracking={"uri": mlflow_uri, "experiment": f"vectorized-{mode}"},
                rounds=2,
            )
        )
        captured = {}

        def inspect(round_index, simulation, captured=captured):
            captured["states"] = simulation.client_states()
            captured["w"] = simulation.server_state().w

        run_experiment(config, show_progress=False, inspect=inspect)
        finals[mode] = captured
    np.testing.assert_allclose(finals["vectorized"]["w"], finals["sequential"]["w"], atol=1e-5)
    # Batched kernels sum in another order: bit-identical models would mean the actors never trained vectorized.
    assert not np.array_equal(finals["vectorized"]["w"], finals["sequential"]["w"])
    for client, state in finals["sequential"]["states"].items():
        np.testing.assert_allclose(finals["vectorized"]["states"][client].theta, state.theta, atol=1e-5)
