"""`raysim server`: a real MLflow tracking server on 127.0.0.1 with a sqlite backend and served artifacts."""

from __future__ import annotations

import json
import urllib.request

import psutil
import pytest

from raysim.tracking.mlflow_writer import MlflowWriter
from raysim.tracking.server import ServerSettings, TrackingServer, is_healthy, listening_pids
from tests.support.cluster import free_port


@pytest.mark.slow
def test_server_takes_runs_and_artifacts_over_http_and_stops(tmp_path):
    """... in one process (raysim.tracking.mlflow_server: MLflow's command, its uvicorn run in that process)."""
    settings = ServerSettings(f"sqlite:///{tmp_path / 'db.sqlite'}", str(tmp_path / "artifacts"), port=free_port())
    server = TrackingServer(settings, tmp_path / "server.log")
    with server:
        assert listening_pids(settings.port) == {server.process.pid}
        assert not psutil.Process(server.process.pid).children(recursive=True)
        writer = MlflowWriter(settings.url, "served")
        run_id = writer.start("r", {"a": 1}, {})
        writer.log_metrics(1, {"pm/acc": 0.5})
        (tmp_path / "note.txt").write_text("hello")
        writer.log_artifact(tmp_path / "note.txt")
        writer.finish()
        query = f"run_id={run_id}&metric_key=pm/acc"
        with urllib.request.urlopen(f"{settings.url}/api/2.0/mlflow/metrics/get-history?{query}") as response:
            assert [m["value"] for m in json.load(response)["metrics"]] == [0.5]
        assert list((tmp_path / "artifacts").rglob("note.txt")), "artifacts land in the server's store"
    assert server.process.poll() is not None
    assert not is_healthy(settings.url)
