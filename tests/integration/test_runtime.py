"""The Ray runtime: invariants on live actor state, packing determinism, state of unselected clients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray

from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.experiments import tiny_config


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


def _final_states(num_hosts: int, mlflow_uri: str, actors: str = "ray") -> tuple[dict, list]:
    """FLAME with its ADMM diagnostics (which train the same: tests/unit/test_admm_diagnostics.py), so that their
    running totals are checked too; the hosts on Ray actors, named in Ray's dashboard, or in this process
    (runtime.actors)."""
    config = validate_config(
        tiny_config(
            algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "diagnostics": True},
            clients={"count": 5, "per_round": 3},
            runtime={"num_hosts": num_hosts, "host_cpus": 0.5, "actors": actors},
            tracking={"uri": mlflow_uri, "experiment": "packing"},
            rounds=3,
        )
    )
    captured = {}

    def inspect(round_index, simulation):
        captured["states"] = simulation.client_states()
        captured["w"] = simulation.server_state().w
        captured["totals"] = simulation.server_state().diagnostics
        if actors != "ray":
            return
        crew = simulation.actors.crew_name
        names = {f"{crew}/host-{i}" for i in range(num_hosts)} | {f"{crew}/coordinator"}
        assert names <= set(ray.util.list_named_actors()), "the actors are named in Ray's dashboard"

    result = run_experiment(config, show_progress=False, inspect=inspect)
    return captured, result.final


def test_same_seed_same_results_with_1_and_3_hosts(ray_local, mlflow_uri):
    """Per-client randomness is keyed by (seed, client, round) and uploads are summed exactly, so packing
    clients into 1 or 3 host actors gives bit-identical client states, global model, diagnostics and evaluations.
    The one host runs in this process (what a Ray host computes: tests/integration/test_matrix_on_ray.py), which
    spares the start of two actors; the three hosts are Ray actors."""
    one, evaluations_one = _final_states(1, mlflow_uri, actors="in_process")
    three, evaluations_three = _final_states(3, mlflow_uri)
    np.testing.assert_array_equal(one["w"], three["w"])
    assert sorted(one["states"]) == sorted(three["states"]) == list(range(5))
    for client_id, state in one["states"].items():
        other = three["states"][client_id]
        for name in ("theta", "w", "pi", "reported_smooth"):
            np.testing.assert_array_equal(getattr(state, name), getattr(other, name))
    np.testing.assert_array_equal(one["totals"].dual_sum, three["totals"].dual_sum)
    assert vars(one["totals"]).keys() == vars(three["totals"]).keys()
    for name in ("smooth_sum", "reported", "coupling"):
        assert getattr(one["totals"], name) == getattr(three["totals"], name), name
    np.testing.assert_equal([e.row() for e in evaluations_one], [e.row() for e in evaluations_three])


@pytest.mark.parametrize("sampling", ["uniform", "bernoulli"])
def test_unselected_clients_keep_their_state_bit_for_bit(sampling, ray_local, mlflow_uri):
    """Algorithm 1 lines 17-18: clients outside S^t do nothing (checked across real rounds on the actors), with
    either way of drawing S^t."""
    clients = {"count": 6, "per_round": 2, "sampling": sampling}
    config = validate_config(tiny_config(clients=clients, tracking={"uri": mlflow_uri}, rounds=4))
    from raysim.runtime.problem import sample_clients

    snapshots = {}

    def inspect(round_index, simulation):
        snapshots[round_index] = simulation.client_states()

    run_experiment(config, show_progress=False, inspect=inspect)
    unchanged_seen = expected_unchanged = 0
    for round_index in range(1, 4):
        selected = set(sample_clients(config.seed, round_index, 6, 2, sampling))
        expected_unchanged += 6 - len(selected)
        for client_id in range(6):
            before, after = snapshots[round_index - 1][client_id], snapshots[round_index][client_id]
            same = all(np.array_equal(getattr(before, n), getattr(after, n)) for n in ("theta", "w", "pi"))
            assert same == (client_id not in selected), (round_index, client_id)
            unchanged_seen += same
    assert unchanged_seen == expected_unchanged


def _maps(pid: int, library: str) -> bool:
    """Whether a process has a library mapped (read from /proc, as it is, not as the process reports)."""
    return library in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize(
    ("algorithm", "on_coordinator"),
    [({"name": "flame", "lr": 0.05}, False), ({"name": "fedslr", "lambda": 0.05, "lr": 0.05}, True)],
)
def test_only_a_coordinator_whose_server_step_needs_torch_loads_it(ray_local, mlflow_uri, algorithm, on_coordinator):
    """The coordinator of most algorithms only adds vectors: it never loads torch (it starts about a second sooner
    and holds 200 MB less); FedSLR's server step (an SVD in torch) loads it there; hosts train with it. No actor
    loads pandas (0.3 s of CPU and 39 MiB each): the hosts' Arrow columns are built without pyarrow's pandas check."""
    import ray

    config = validate_config(
        tiny_config(algorithm=algorithm, rounds=2, tracking={"uri": mlflow_uri, "experiment": "coordinator-torch"})
    )
    seen: dict[str, object] = {}

    def inspect(round_index, simulation):
        coordinator, *hosts = ray.get([actor.pid.remote() for actor in (simulation.coordinator, *simulation.hosts)])
        seen["coordinator"] = _maps(coordinator, "libtorch")
        seen["hosts"] = [_maps(pid, "libtorch") for pid in hosts]
        seen["pandas"] = [_maps(pid, "/pandas/_libs/") for pid in (coordinator, *hosts)]

    run_experiment(config, show_progress=False, inspect=inspect)
    assert seen == {"coordinator": on_coordinator, "hosts": [True, True], "pandas": [False, False, False]}
