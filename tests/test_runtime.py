"""The Ray runtime: invariants on live actor state, packing determinism, state of unselected clients."""

from __future__ import annotations

import numpy as np

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.conftest import tiny_config


def test_flame_invariants_hold_on_actor_state_after_every_round(ray_local, mlflow_uri):
    """Lemma 3 and u_i = theta_i (rho = lambda/m) checked on the host actors' state after every round."""
    config = validate_config(
        tiny_config(
            algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05},
            tracking={"uri": mlflow_uri, "experiment": "invariants"},
            rounds=3,
        )
    )
    checked = []

    def inspect(round_index, simulation):
        states = simulation.client_states()
        for state in states.values():
            np.testing.assert_allclose(state.pi, 0.25 * (state.theta - state.w), atol=2e-6)
            np.testing.assert_allclose(state.w + state.pi / 0.25, state.theta, atol=2e-6)
        np.testing.assert_allclose(
            simulation.server_state().w, np.mean([s.theta for s in states.values()], axis=0), atol=2e-6
        )
        checked.append(round_index)

    run_experiment(config, show_progress=False, inspect=inspect)
    assert checked == [0, 1, 2]


def _final_states(num_hosts: int, mlflow_uri: str) -> tuple[dict, list]:
    config = validate_config(
        tiny_config(
            clients={"count": 5, "per_round": 3},
            runtime={"num_hosts": num_hosts, "host_cpus": 0.5},
            tracking={"uri": mlflow_uri, "experiment": "packing"},
            rounds=3,
        )
    )
    captured = {}

    def inspect(round_index, simulation):
        captured["states"] = simulation.client_states()
        captured["w"] = simulation.server_state().w

    result = run_experiment(config, show_progress=False, inspect=inspect)
    return captured, result.final


def test_same_seed_same_results_with_1_and_3_hosts(ray_local, mlflow_uri):
    """Per-client randomness is keyed by (seed, client, round) and uploads are summed exactly, so packing
    clients into 1 or 3 host actors gives bit-identical client states, global model and evaluations."""
    one, evaluations_one = _final_states(1, mlflow_uri)
    three, evaluations_three = _final_states(3, mlflow_uri)
    np.testing.assert_array_equal(one["w"], three["w"])
    assert sorted(one["states"]) == sorted(three["states"]) == list(range(5))
    for client_id, state in one["states"].items():
        other = three["states"][client_id]
        for name in ("theta", "w", "pi"):
            np.testing.assert_array_equal(getattr(state, name), getattr(other, name))
    np.testing.assert_equal([e.row() for e in evaluations_one], [e.row() for e in evaluations_three])


def test_unselected_clients_keep_their_state_bit_for_bit(ray_local, mlflow_uri):
    """Algorithm 1 lines 17-18: clients outside S^t do nothing (checked across real rounds on the actors)."""
    config = validate_config(tiny_config(clients={"count": 6, "per_round": 2}, tracking={"uri": mlflow_uri}, rounds=4))
    from raysim.runtime.driver import sample_clients

    snapshots = {}

    def inspect(round_index, simulation):
        snapshots[round_index] = simulation.client_states()

    run_experiment(config, show_progress=False, inspect=inspect)
    unchanged_seen = 0
    for round_index in range(1, 4):
        selected = set(sample_clients(config.seed, round_index, 6, 2))
        for client_id in range(6):
            before, after = snapshots[round_index - 1][client_id], snapshots[round_index][client_id]
            same = all(np.array_equal(getattr(before, n), getattr(after, n)) for n in ("theta", "w", "pi"))
            assert same == (client_id not in selected), (round_index, client_id)
            unchanged_seen += same
    assert unchanged_seen == 3 * 4
