"""The Ray runtime: invariants on live actor state, packing determinism, state of unselected clients."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import ray

from raysim.config import RuntimeSettings, validate_config
from raysim.errors import ConfigError
from raysim.runtime.driver import run_experiment
from raysim.runtime.placement import check_capacity, default_num_hosts
from tests.support.cli import raysim, run_cli, write_config
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


def _final_states(num_hosts: int, mlflow_uri: str) -> tuple[dict, list]:
    """FLAME with its ADMM diagnostics (which train the same: tests/test_admm_diagnostics.py), so that their
    running totals are checked too."""
    config = validate_config(
        tiny_config(
            algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "diagnostics": True},
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
        captured["totals"] = simulation.server_state().diagnostics
        crew = simulation.crew_name
        names = {f"{crew}/host-{i}" for i in range(num_hosts)} | {f"{crew}/coordinator"}
        assert names <= set(ray.util.list_named_actors()), "the actors are named in Ray's dashboard"

    result = run_experiment(config, show_progress=False, inspect=inspect)
    return captured, result.final


def test_same_seed_same_results_with_1_and_3_hosts(ray_local, mlflow_uri):
    """Per-client randomness is keyed by (seed, client, round) and uploads are summed exactly, so packing
    clients into 1 or 3 host actors gives bit-identical client states, global model, diagnostics and evaluations."""
    one, evaluations_one = _final_states(1, mlflow_uri)
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


@pytest.mark.slow
def test_gpu_shares_bound_the_host_count_on_a_real_ray(tmp_path, mlflow_uri):
    """A local Ray declaring one GPU (it need not exist: a host without CUDA trains on the CPU) takes two
    hosts at 0.5 GPU each, though its CPUs would hold four; declaring none refuses the run with the key."""
    runtime = {"num_cpus": 2, "num_gpus": 1, "host_cpus": 0.5, "host_gpus": 0.5, "client_training": "vectorized"}
    tracking = {"uri": mlflow_uri, "experiment": "gpus"}
    run = run_cli(tmp_path, tiny_config(runtime=runtime, tracking=tracking, rounds=2))
    assert run.info.status == "FINISHED" and run.data.tags["raysim.hosts"] == "2"

    refused = tiny_config(runtime={**runtime, "num_gpus": 0}, tracking=tracking, rounds=2)
    done = raysim("run", str(write_config(tmp_path, refused)), "--quiet", cwd=tmp_path)
    assert done.returncode != 0
    assert "runtime.host_gpus=0.5 (+ coordinator 0) needs 0.5 GPUs but the Ray cluster has 0" in done.stderr


def _loads_torch(pid: int) -> bool:
    """Whether a process has torch's library mapped (read from /proc, as it is, not as the process reports)."""
    return "libtorch" in Path(f"/proc/{pid}/maps").read_text()


@pytest.mark.parametrize(
    ("algorithm", "on_coordinator"),
    [({"name": "flame", "lr": 0.05}, False), ({"name": "fedslr", "lambda": 0.05, "lr": 0.05}, True)],
)
def test_only_a_coordinator_whose_server_step_needs_torch_loads_it(ray_local, mlflow_uri, algorithm, on_coordinator):
    """The coordinator of most algorithms only adds vectors: it never loads torch (it starts about a second sooner
    and holds 200 MB less); FedSLR's server step (an SVD in torch) loads it there; hosts train with it."""
    import ray

    config = validate_config(
        tiny_config(algorithm=algorithm, rounds=2, tracking={"uri": mlflow_uri, "experiment": "coordinator-torch"})
    )
    seen: dict[str, object] = {}

    def inspect(round_index, simulation):
        seen["coordinator"] = _loads_torch(ray.get(simulation.coordinator.pid.remote()))
        seen["hosts"] = [_loads_torch(ray.get(host.pid.remote())) for host in simulation.hosts]

    run_experiment(config, show_progress=False, inspect=inspect)
    assert seen == {"coordinator": on_coordinator, "hosts": [True, True]}


SIBLINGS_SCRIPT = """
import gc, time, ray
from raysim.runtime.actors import get_all

@ray.remote(num_cpus=0)
class Host:
    def train(self, delay, name):
        time.sleep(delay)
        raise ValueError(name)

def fail_round(name, retrieve):
    hosts = [Host.remote(), Host.remote()]
    refs = [host.train.remote(delay, name) for host, delay in zip(hosts, [0.0, 2.0])]
    try:
        get_all(refs) if retrieve else ray.get(refs)
    except ray.exceptions.RayTaskError:
        pass
    time.sleep(3)  # the refs live on in the error's traceback while the late sibling fails
    del refs
    gc.collect()
    time.sleep(1)

ray.init(num_cpus=1, include_dashboard=False)
fail_round("left-unretrieved", retrieve=False)
fail_round("retrieved", retrieve=True)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_failed_rounds_late_sibling_errors_are_got_so_ray_prints_no_unhandled_error(tmp_path):
    """A call to the hosts (a round, an evaluation) whose first host failed waits for the others and gets their
    results (`get_all`): a sibling failing a little later was dropped unread, and Ray printed its traceback as an
    "Unhandled error" on a suite's console. The control (a plain `ray.get` of the list) shows the test sees such a
    line."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", SIBLINGS_SCRIPT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("Unhandled error") == 1 and "ValueError: left-unretrieved" in done.stderr, done.stderr
    assert "ValueError: retrieved" not in done.stderr, done.stderr
