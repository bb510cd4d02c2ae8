"""A real multi-node Ray cluster on 127.0.0.1: a head and two worker nodes, each its own `ray start`.

The cluster runs with token authentication (a fresh random token) and a dedicated temp dir and ports,
and the fixture stops exactly its own processes (found by its token in their environment), never
other Ray instances on the machine. Drivers that connect to it run as
subprocesses (a probe, or Ray Jobs), so this test process never joins it.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from raysim.config import validate_config
from tests.conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent
RAY = str(Path(sys.executable).parent / "ray")
NODES = {
    "head": {"num_cpus": 1, "resources": {"coordinator": 1}},
    "worker_a": {"num_cpus": 1, "resources": {"host_slot": 2, "worker_a": 1}},
    "worker_b": {"num_cpus": 1, "resources": {"host_slot": 2, "worker_b": 1}},
}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LocalCluster:
    """Head + workers as separate `ray start` processes; token auth on; stopped by process id."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="rs7-", dir="/tmp"))
        self.token = secrets.token_hex(16)
        self.gcs_port = free_port()
        self.dashboard_port = free_port()
        self.env = {
            **os.environ,
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN": self.token,
            "RAY_USAGE_STATS_ENABLED": "0",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # as if activated
        }
        self.env.pop("RAY_ADDRESS", None)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    @property
    def dashboard(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    def driver_env(self) -> dict[str, str]:
        """Environment of a driver process that connects to this cluster."""
        return {**self.env, "RAY_ADDRESS": self.address}

    def _start(self, name: str, head: bool) -> None:
        spec = NODES[name]
        command = [RAY, "start", "--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
        command += ["--num-cpus", str(spec["num_cpus"]), "--resources", json.dumps(spec["resources"])]
        command += ["--object-store-memory", str(160 * 2**20), "--temp-dir", str(self.root)]
        for flag in (
            "--dashboard-agent-listen-port",
            "--dashboard-agent-grpc-port",
            "--runtime-env-agent-port",
            "--metrics-export-port",
        ):
            command += [flag, str(free_port())]
        if head:
            command += ["--head", "--port", str(self.gcs_port), "--include-dashboard", "true"]
            command += ["--dashboard-host", "127.0.0.1", "--dashboard-port", str(self.dashboard_port)]
            command += ["--ray-client-server-port", str(free_port())]
        else:
            command += ["--address", self.address]
        subprocess.run(command, env=self.env, check=True, capture_output=True, timeout=120)

    def start(self) -> LocalCluster:
        self._start("head", head=True)
        for name in NODES:
            if name != "head":
                self._start(name, head=False)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(self.nodes()) == len(NODES):
                return self
            time.sleep(1)
        raise RuntimeError(f"cluster did not reach {len(NODES)} nodes: {self.nodes()}")

    def nodes(self) -> list[dict]:
        request = urllib.request.Request(
            f"{self.dashboard}/nodes?view=summary", headers={"Authorization": f"Bearer {self.token}"}
        )
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                summary = json.load(response)["data"]["summary"]
        except OSError:
            return []
        return [n for n in summary if n.get("raylet", {}).get("state") == "ALIVE"]

    def own_pids(self) -> list[int]:
        """Processes of this cluster: they (and every job driver, worker and agent they start) carry its
        unique token in their environment, or name its temp dir on their command line."""
        token = f"RAY_AUTH_TOKEN={self.token}".encode()
        marker = str(self.root).encode()
        found = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                environ = (entry / "environ").read_bytes()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if token in environ.split(b"\0") or marker in cmdline:
                found.append(int(entry.name))
        return found

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid in self.own_pids():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while self.own_pids() and time.monotonic() < deadline:
                time.sleep(0.3)
        shutil.rmtree(self.root, ignore_errors=True)


def placement_config(placement: str, uri: str) -> dict:
    return tiny_config(
        clients={"count": 6, "per_round": 4},
        rounds=3,
        runtime={
            "num_hosts": 2,
            "host_cpus": 0.5,
            "placement": placement,
            "host_resources": {"host_slot": 1},
            "coordinator_resources": {"coordinator": 1},
        },
        tracking={"uri": uri, "experiment": "placement"},
    )


def probe(configs_path: str, out_path: str) -> None:
    """Driver run in a subprocess connected to the cluster: runs each config, records where actors ran."""
    import ray

    from raysim.runtime.driver import run_experiment

    ray.init()  # RAY_ADDRESS: the cluster; run_experiment then reuses this connection
    outcome = {}
    for name, data in json.loads(Path(configs_path).read_text()).items():
        captured: dict = {}

        def inspect(round_index, simulation, captured=captured):
            where = [a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()) for a in simulation.hosts]
            captured["hosts"] = ray.get(where)
            captured["coordinator"] = ray.get(
                simulation.coordinator.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            )
            captured["states"] = simulation.client_states()
            captured["w"] = simulation.server_state().w

        run_experiment(validate_config(data), show_progress=False, inspect=inspect)
        outcome[name] = captured
    outcome["nodes"] = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    Path(out_path).write_bytes(pickle.dumps(outcome))


@pytest.mark.slow
def test_hosts_land_on_intended_nodes_and_match_single_process_run(cluster, tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    configs = {p: placement_config(p, uri) for p in ("spread", "pack")}
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    subprocess.run(
        [sys.executable, "-m", "tests.test_cluster", str(tmp_path / "configs.json"), str(tmp_path / "out.pkl")],
        cwd=ROOT,
        env=cluster.driver_env(),
        check=True,
        timeout=600,
    )
    outcome = pickle.loads((tmp_path / "out.pkl").read_bytes())
    nodes = outcome["nodes"]
    assert len(nodes) == 3
    for placement in ("spread", "pack"):
        run = outcome[placement]
        assert all(nodes[n].get("host_slot") for n in run["hosts"]), placement
        assert nodes[run["coordinator"]].get("coordinator") == 1.0, placement
    assert len(set(outcome["spread"]["hosts"])) == 2  # one host on each worker node
    assert len(set(outcome["pack"]["hosts"])) == 1  # both hosts on one worker node

    from tests.inprocess import InProcess

    reference = InProcess(validate_config(configs["spread"]))
    for round_index in range(3):
        reference.round(round_index)
    for placement in ("spread", "pack"):
        np.testing.assert_array_equal(outcome[placement]["w"], reference.server.w)
        for client_id, state in reference.states.items():
            ran = outcome[placement]["states"][client_id]
            for name in ("theta", "w", "pi"):
                np.testing.assert_array_equal(getattr(ran, name), getattr(state, name))


def _rest(server: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{server}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}") as response:
        return json.load(response)


@pytest.mark.slow
def test_submitted_sweep_logs_to_tracking_server(cluster, tmp_path, capsys):
    from raysim.cli import main
    from raysim.server import ServerSettings, TrackingServer

    sweep = {
        "name": "cluster-sweep",
        "base": tiny_config(
            rounds=2,
            runtime={"num_hosts": 2, "host_cpus": 0.5, "placement": "spread", "host_resources": {"host_slot": 1}},
            tracking={"experiment": "cluster-sweep"},
        ),
        "grid": {"algorithm.rho": [0.1, 0.25]},
        "seeds": [1, 2],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(sweep))
    settings = ServerSettings(
        f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts"), "127.0.0.1", free_port()
    )
    with TrackingServer(settings, tmp_path / "server.log"):
        args = ["--address", cluster.dashboard, "--auth-token", cluster.token]
        code = main(["submit", str(path), "--tracking-uri", settings.url, "--follow", *args])
        out = capsys.readouterr().out
        assert code == 0, out
        job_id = out.split("job ", 1)[1].split()[0]
        parent = out.split("mlflow run ", 1)[1].split()[0]
        assert len(parent) == 32
        assert "sweep cluster-sweep: parent run" in out

        assert main(["jobs", *args]) == 0
        listing = capsys.readouterr().out
        assert job_id in listing and "SUCCEEDED" in listing
        assert main(["stop", job_id, *args]) == 0
        assert "already finished" in capsys.readouterr().out

        experiment = _rest(settings.url, "experiments/get-by-name", experiment_name="cluster-sweep")
        experiment_id = experiment["experiment"]["experiment_id"]
        request = urllib.request.Request(
            f"{settings.url}/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [experiment_id], "max_results": 100}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as response:
            runs = json.load(response)["runs"]
        children = [r for r in runs if {"key": "mlflow.parentRunId", "value": parent} in r["data"].get("tags", [])]
        assert len(children) == 4
        assert all(r["info"]["status"] == "FINISHED" for r in children)
        for child in children:
            history = _rest(settings.url, "metrics/get-history", run_id=child["info"]["run_id"], metric_key="pm/acc")
            assert [m["step"] for m in history["metrics"]] == [0, 1, 2]
            assert all(0.0 <= m["value"] <= 1.0 for m in history["metrics"])
        files = {f["path"] for f in _rest(settings.url, "artifacts/list", run_id=parent).get("files", [])}
        assert {"summary.parquet", "accuracy_vs_round.png", "final_accuracy.png"} <= files


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2])
