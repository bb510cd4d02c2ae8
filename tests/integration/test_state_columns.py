"""Client state in one store every host reads and writes (runtime.state_store = memory or disk, issue 49): a round's
clients are dealt to the hosts by cost, and the results are those of hosts that own their clients, bit for bit,
whatever the number of hosts, whether the store is in memory or on disk, after a resume from its snapshot and after
a host is killed."""

from __future__ import annotations

import os
import signal
from typing import Any

import numpy as np
import pytest
import ray
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.runtime.driver import resume_experiment, run_experiment
from raysim.runtime.problem import sample_clients
from tests.support.experiments import tiny_config
from tests.support.reliability import baseline_run, reliability_config

pytestmark = pytest.mark.xdist_group("integration-state-columns")

REUSED = {"reuse_actors": True}
"""The Ray runs keep their actors for the next run of the module with as many hosts (runtime.reuse_actors): the
killed-host run takes the 2 hosts and coordinator of the disk store's run instead of starting 3 actors
(tests/integration/test_crews.py shows renewed actors give a new crew's results)."""


VECTORIZED_IN_TWOS = {"client_training": "vectorized", "vectorize_chunk": 2}


def _run(mlflow_uri: str, runtime: dict[str, Any], inspect: Any = None) -> tuple[dict, Any]:
    config = validate_config(
        tiny_config(
            algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32, "diagnostics": True},
            clients={"count": 7, "per_round": 4},
            runtime={"host_cpus": 0.5, "client_training": "vectorized", "vectorize_chunk": 2, **REUSED, **runtime},
            tracking={"uri": mlflow_uri, "experiment": "columns"},
            rounds=3,
        )
    )
    captured: dict[str, Any] = {}

    def capture(round_index, simulation):
        captured["states"] = simulation.client_states()
        captured["w"] = simulation.server_state().w

    result = run_experiment(config, show_progress=False, inspect=inspect or capture)
    return captured, result


def test_shared_store_runs_equal_owned_state_runs_bit_for_bit_with_1_2_and_3_hosts(ray_local, mlflow_uri, tmp_path):
    """Owned state on 1 host (in process: what a Ray host computes, tests/integration/test_matrix_on_ray.py) against
    the store in memory on 3 Ray hosts and on disk on 2; the disk store's folder is gone at the end and its size is
    logged."""
    one, result_one = _run(mlflow_uri, {"num_hosts": 1, "actors": "in_process", "state_store": "hosts"})
    spill = tmp_path / "spill"
    for runtime in ({"num_hosts": 3, "state_store": "memory"}, {"num_hosts": 2}):  # auto, spill_dir set: disk
        other, result = _run(mlflow_uri, {**runtime, "spill_dir": str(spill)})
        np.testing.assert_array_equal(one["w"], other["w"])
        assert sorted(other["states"]) == list(range(7))
        for client, state in one["states"].items():
            for name in ("theta", "w", "pi", "reported_smooth"):
                np.testing.assert_array_equal(getattr(state, name), getattr(other["states"][client], name))
        assert result.summary == result_one.summary
        assert repr(result.final) == repr(result_one.final)
        metrics = MlflowClient(mlflow_uri).get_run(result.run_id).data.metrics
        assert MlflowClient(mlflow_uri).get_run(result.run_id).data.tags["raysim.state_store"] == runtime.get(
            "state_store", "disk"
        )
        trained = set().union(*(sample_clients(7, r, 7, 4) for r in range(3)))
        assert metrics["state/spilled_clients"] == len(trained) and metrics["state/disk_bytes"] > 0
        assert metrics["time/hosts_busy_max"] >= metrics["time/hosts_busy_balanced"] > 0
    assert [p for p in spill.iterdir() if p.name.startswith("raysim-states-columns-")] == []


def test_runs_of_consecutive_clients_stepped_in_place_in_the_memory_store_equal_owned_state_bit_for_bit(mlflow_uri):
    """Enough clients for `deal` to deal groups of the hosts' chunk (GROUPS_PER_HOST a host): each host's chunks are
    consecutive ids, stepped in place in the mapped columns (not copied in and out), and the run is that of one
    host owning every client's state, bit for bit."""
    runs = {}
    for store, hosts in (("hosts", 1), ("memory", 2)):
        dealt: list[list[list[int]]] = []

        def capture(round_index, simulation, dealt=dealt, store=store):
            dealt.append(getattr(simulation, "dealt", []))
            runs[store] = (simulation.client_states(), simulation.server_state().w)

        config = validate_config(
            tiny_config(
                algorithm={"name": "flame", "lambda": 1.0, "rho": 0.25, "lr": 0.05, "batch_size": 32},
                partition={"scheme": "iid"},
                clients={"count": 40},
                runtime={"actors": "in_process", "num_hosts": hosts, "state_store": store, **VECTORIZED_IN_TWOS},
                tracking={"uri": mlflow_uri, "experiment": "columns-in-place"},
                rounds=2,
            )
        )
        run_experiment(config, show_progress=False, inspect=capture)
    for host in dealt[-1]:
        assert len(host) == 20 and all(host[i + 1] == host[i] + 1 for i in range(0, len(host), 2))
    (owned, owned_w), (shared, shared_w) = runs["hosts"], runs["memory"]
    np.testing.assert_array_equal(owned_w, shared_w)
    for client, state in owned.items():
        for name in ("theta", "w", "pi"):
            np.testing.assert_array_equal(getattr(state, name), getattr(shared[client], name))


def test_a_run_on_the_disk_store_resumes_from_its_snapshot_exactly(mlflow_uri, tmp_path):
    """Interrupted after round 3 (last checkpoint round 2's: a snapshot of the store), resumed: the uninterrupted
    run of hosts owning their clients' state."""
    baseline = baseline_run(tmp_path / "baseline", {"actors": "in_process", "num_hosts": 2, "state_store": "hosts"})
    runtime = {"actors": "in_process", "num_hosts": 3, "state_store": "disk", "spill_dir": str(tmp_path / "spill")}
    config = validate_config(reliability_config(mlflow_uri, tmp_path, runtime))

    def die(round_index, simulation):
        if round_index == 2:
            raise KeyboardInterrupt("driver killed")

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, show_progress=False, inspect=die)
    client = MlflowClient(mlflow_uri)
    run_id = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0].info.run_id
    assert sorted(p.name for p in (tmp_path / "ckpt" / run_id / "round-000002").glob("state-*.npy"))[:2] == [
        "state-ids.npy",
        "state-pi.npy",
    ]
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.summary == baseline.summary
    assert repr(resumed.final) == repr(baseline.final)


def test_a_killed_host_of_a_shared_store_run_is_replaced_and_the_run_is_unchanged(ray_local, mlflow_uri, tmp_path):
    """Host 0 killed after round 2 (its rows of round 3 may be half written): the store goes back to round 2's
    snapshot and the run equals the uninterrupted one of hosts owning their clients."""
    baseline = baseline_run(tmp_path / "baseline", {"actors": "in_process", "num_hosts": 2, "state_store": "hosts"})
    runtime = {"num_hosts": 2, "host_cpus": 0.5, **REUSED}  # the default store: auto, in /dev/shm here
    config = validate_config(reliability_config(mlflow_uri, tmp_path, runtime))
    killed: list[int] = []

    def kill(round_index, simulation):
        if round_index == 2 and not killed:
            pid = ray.get(simulation.hosts[0].pid.remote())
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    result = run_experiment(config, show_progress=False, inspect=kill)
    assert killed
    assert result.summary == baseline.summary
    assert repr(result.final) == repr(baseline.final)
