"""The shared MLflow tracking server: a database backend store plus a served artifact store.

`mlflow server` with its defaults starts 15 processes and 2.2 GB; one worker with job execution off
starts in about 6 s with 0.4 GB (platform.md), so that is what `raysim server` runs. With
`--artifacts-destination` the server proxies artifacts (clients need only the http:// tracking URI,
no shared file system). Bind to 127.0.0.1 unless the cluster's nodes must reach it (then 0.0.0.0
behind your network's protection: the server has no authentication).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from raysim.errors import RaysimError
from raysim.tracking.credentials import connect_uri, redact


class ServerError(RaysimError):
    """The tracking server did not come up."""


@dataclass(frozen=True)
class ServerSettings:
    backend_store_uri: str = "sqlite:///mlflow.db"
    """sqlite:///path, or postgresql://user:password@host:5432/db (needs psycopg2 on the server)"""
    artifacts_destination: str | None = "./mlartifacts"
    """where the server stores artifacts (a directory, s3://..., ...); None: no artifact serving"""
    host: str = "127.0.0.1"
    port: int = 5000
    workers: int = 1

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", self.backend_store_uri]
        if self.artifacts_destination:
            destination = self.artifacts_destination
            if "://" not in destination:
                destination = str(Path(destination).resolve())
            command += ["--serve-artifacts", "--artifacts-destination", destination]
        return command + ["--host", self.host, "--port", str(self.port), "--workers", str(self.workers)]


def _group_alive(process: subprocess.Popen) -> bool:
    """Whether any process of the group `process` leads is left (the leader reaped if it exited)."""
    process.poll()
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    return True


def server_env() -> dict[str, str]:
    return {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def is_healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


class TrackingServer:
    """A tracking server in its own process group, stopped with everything it started."""

    def __init__(self, settings: ServerSettings, log_path: Path | None = None):
        self.settings = settings
        self.log_path = log_path
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> TrackingServer:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL  # noqa: SIM115
        self.process = subprocess.Popen(
            self.settings.command(), env=server_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"mlflow server exited with code {self.process.returncode} (log: {self.log_path})")
            if is_healthy(self.settings.url):
                return self
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"mlflow server not healthy at {self.settings.url} after {timeout_s:.0f} s")

    def stop(self, wait_s: float = 15.0) -> None:
        """SIGTERM to the server's whole process group (its workers too, even when the leader has already
        exited), SIGKILL to whatever is left after `wait_s`."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait_s
            while time.monotonic() < deadline and _group_alive(self.process):
                time.sleep(0.1)
        self.process.wait()

    def __enter__(self) -> TrackingServer:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


def runs_page(url: str, tracking_uri: str, experiment: str | None = None) -> str:
    """The UI link that opens an experiment's runs table in MLflow's model-training view: `experiment` if
    given and present, else the experiment whose runs changed last; the experiments list if there is none."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(connect_uri(tracking_uri))
    view = "workflowType=machine_learning"  # MLflow 3 opens in its GenAI view unless told
    found = client.get_experiment_by_name(experiment) if experiment else None
    if found is None:
        recent = client.search_experiments(order_by=["last_update_time DESC"])
        found = next((e for e in recent if client.search_runs([e.experiment_id], max_results=1)), None)
    if found is None:
        return f"{url}/#/experiments?{view}"
    return f"{url}/#/experiments/{found.experiment_id}/runs?{view}"


def serve(settings: ServerSettings, what: str = "MLflow tracking server", landing: str | None = None) -> int:
    """Run the server in the foreground until Ctrl-C or SIGTERM, then stop it with every process it started
    (the server runs in its own process group, so nothing is left holding the port); `landing`: a link to
    print for the user to open."""
    from raysim.errors import sigterm_interrupts

    artifacts = f", artifacts {settings.artifacts_destination}" if settings.artifacts_destination else ""
    print(f"{what} on {settings.url} (backend {redact(settings.backend_store_uri)}{artifacts})", flush=True)
    if landing:
        print(f"open {landing}", flush=True)
    server = TrackingServer(settings)
    with sigterm_interrupts():
        try:
            server.process = subprocess.Popen(settings.command(), env=server_env(), start_new_session=True)
            return server.process.wait()
        finally:
            server.stop()
