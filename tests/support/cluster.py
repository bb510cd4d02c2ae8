"""Test helpers for real multi-node Ray clusters on 127.0.0.1: `LocalCluster` (a head and two worker nodes,
each its own `ray start`, token authentication, its own temp dir and ports), free ports, and a census of the
processes a cluster started (by a marker in their environment), independent of how it is stopped."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from raysim.jobs import stop_nodes

RAY = str(Path(sys.executable).parent / "ray")
NODES = {
    "head": {"num_cpus": 1, "resources": {"coordinator": 1}},
    "worker_a": {"num_cpus": 1, "resources": {"host_slot": 2, "worker_a": 1}},
    "worker_b": {"num_cpus": 1, "resources": {"host_slot": 2, "worker_b": 1}},
}


FREE_PORTS = range(20000, 32768)
"""Where tests take ports for their servers: above Ray's worker ports (10002-19999) and below the kernel's
ephemeral range (32768-60999, where port 0 binds and outgoing connections go), so that no Ray worker or client
socket of a test running beside takes a port between its choice and its server's start (seen in CI: an MLflow
server's port answered by a Ray process)."""


def free_port() -> int:
    while True:
        port = secrets.choice(FREE_PORTS)
        with socket.socket() as probe, contextlib.suppress(OSError):
            probe.bind(("127.0.0.1", port))
            return port


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

    def _command(self, name: str, head: bool) -> list[str]:
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
            # The nodes share one temp dir, hence one session's logs folder: the head's log monitor already sends
            # every node's worker output to the drivers. A worker node's own would rescan and send that same folder
            # again, ten times a second for the whole module (about a third of the cluster's daemon CPU).
            command += ["--address", self.address, "--include-log-monitor", "false"]
        return command

    def _start(self, name: str, head: bool) -> None:
        """`ray start` for one node, three tries with fresh ports: on a loaded machine a raylet can time out during
        start-up (seen for the head too, under a load of 40 on 2 cores), or a port picked free can be taken by
        another test's process meanwhile. A head's next try also moves its GCS and dashboard ports, after ending
        what the failed one left."""
        for attempt in range(3):
            if head and attempt:
                kill_all(self.own_pids, wait_s=0)
                self.gcs_port, self.dashboard_port = free_port(), free_port()
            done = subprocess.run(self._command(name, head), env=self.env, capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                return
        raise RuntimeError(f"ray start of node {name} failed (exit {done.returncode}): {done.stderr[-3000:]}")

    def start(self) -> LocalCluster:
        """The head, then each worker node (one at a time: Ray names a node's sockets by the first free name in the
        temp dir they share, which two nodes starting at once could both take); returns once every node is alive."""
        self._start("head", head=True)
        for name in NODES:
            if name != "head":
                self._start(name, head=False)
        return self._all_alive()

    def _all_alive(self) -> LocalCluster:
        """Returns once as many nodes as NODES has are alive."""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if len(self.nodes()) == len(NODES):
                return self
            time.sleep(0.2)
        raise RuntimeError(f"cluster did not reach {len(NODES)} nodes: {self.nodes()}")

    def raylet(self, name: str) -> int | None:
        """The pid of the raylet of worker node `name` (of NODES; its resources name it on its command line), None once
        it is gone."""
        found = []
        for pid in self.own_pids():
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if b"raylet" in command.split(b"\0")[0] and name.encode() in command:
                found.append(pid)
        assert len(found) <= 1, f"node {name}: raylets {found}"
        return found[0] if found else None

    def restore(self) -> LocalCluster:
        """Every worker node a test took away started again (a fresh `ray start` of its name joining the head): the
        tests that take a node away share the module's cluster instead of each starting one (a worker node's start
        instead of a head's, two workers' and a stop). Returns once every node is alive."""
        for name in NODES:
            if name != "head" and self.raylet(name) is None:
                self._start(name, head=False)
        return self._all_alive()

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
        return processes_with(f"RAY_AUTH_TOKEN={self.token}", str(self.root))

    def stop(self) -> None:
        """stop_nodes, as the cluster guide's recipe does; whatever it missed is killed too and then reported."""
        try:
            stop_nodes(self.root)
        finally:
            missed = kill_all(self.own_pids)
            shutil.rmtree(self.root, ignore_errors=True)
        assert not missed, f"stop_nodes({self.root}) left processes {missed}"


def processes_with(environ_entry: str, in_cmdline: str | None = None) -> list[int]:
    """Processes (not this one) with `environ_entry` (NAME=value) in their environment, or `in_cmdline` on
    their command line: an inherited marker finds everything a cluster started, independently of stop_nodes."""
    wanted = environ_entry.encode()
    marker = in_cmdline.encode() if in_cmdline else None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0") or (marker and marker in cmdline):
            found.append(int(entry.name))
    return found


def kill_all(census, wait_s: float = 10.0) -> list[int]:
    """Wait up to `wait_s` for the processes `census()` lists to go, SIGKILL what is left; returns those."""
    deadline = time.monotonic() + wait_s
    while census() and time.monotonic() < deadline:
        time.sleep(0.3)
    left = census()
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5
    while census() and time.monotonic() < deadline:
        time.sleep(0.3)
    return left
