"""A worker node lost mid-run on a real multi-node local Ray cluster (issue #8).

The driver runs as a subprocess connected to the cluster (as in test_cluster.py); at round 2 it SIGKILLs
the raylet of one worker node, taking that node's host actor with it. The host's placement-group bundle
and actor are recreated on the other worker node, every actor reloads the last checkpoint, and the run
must end with exactly the metrics of an uninterrupted run on the same cluster.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from raysim.studies.procmem import descendants
from tests.support.experiments import tiny_config
from tests.support.paths import ROOT
from tests.support.stores import fresh_store


def _config(uri: str, checkpoints: str) -> dict:
    return tiny_config(
        clients={"count": 6, "per_round": 4},
        rounds=4,
        runtime={
            "num_hosts": 2,
            "host_cpus": 0.5,
            "placement": "spread",
            "host_resources": {"host_slot": 1},
            "coordinator_resources": {"coordinator": 1},
        },
        tracking={"uri": uri, "experiment": "node_loss", "checkpoint_every": 1, "checkpoint_dir": checkpoints},
    )


def probe(config_path: str, out_path: str, raylet_pid: str) -> None:
    """Driver: an uninterrupted run, then the same run with one worker node's raylet killed at round 2."""
    import ray

    from raysim.config import validate_config
    from raysim.runtime.driver import run_experiment

    ray.init()
    config = validate_config(json.loads(Path(config_path).read_text()))
    baseline = run_experiment(config, show_progress=False)
    nodes_before: list[str] = []

    def kill_node(round_index, simulation):
        if round_index == 1 and not nodes_before:
            where = [h.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()) for h in simulation.hosts]
            nodes_before.extend(ray.get(where))
            for pid in descendants(int(raylet_pid)):  # the node vanishes: its raylet and every process under it
                os.kill(pid, signal.SIGKILL)

    survived = run_experiment(config, show_progress=False, inspect=kill_node)
    alive = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
    summaries = {"baseline": baseline.summary, "survived": survived.summary}
    Path(out_path).write_text(json.dumps({**summaries, "hosts_before": nodes_before, "alive": alive}))


@pytest.mark.slow
def test_run_survives_a_lost_worker_node(cluster, tmp_path):
    raylets = [
        pid
        for pid in cluster.own_pids()
        if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        and b"worker_b" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(raylets) == 1, raylets
    config = _config(fresh_store(tmp_path / "mlflow.db"), str(tmp_path / "ckpt"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    command = [
        sys.executable,
        "-m",
        "tests.system.test_node_loss",
        str(tmp_path / "config.json"),
        str(tmp_path / "out.json"),
        str(raylets[0]),
    ]
    subprocess.run(command, cwd=ROOT, env=cluster.driver_env(), check=True, timeout=600)
    outcome = json.loads((tmp_path / "out.json").read_text())
    assert len(set(outcome["hosts_before"])) == 2  # spread: one host per worker node, one of them lost
    assert len(outcome["alive"]) == 2  # the node is gone for good
    assert outcome["survived"] == outcome["baseline"]


if __name__ == "__main__":
    probe(*sys.argv[1:4])
