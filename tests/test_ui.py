"""`raysim ui` serves the MLflow UI on 127.0.0.1 for the tracking store, runs included."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from mlflow.tracking import MlflowClient


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.slow
def test_ui_serves_the_runs_of_the_store(tmp_path, mlflow_uri):
    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment("ui-check")
    run = client.create_run(experiment, run_name="visible")
    client.log_metric(run.info.run_id, "pm/acc", 0.5, step=1)
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", "ui", "--tracking-uri", mlflow_uri, "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        body = None
        deadline = time.monotonic() + 120
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [experiment]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        while time.monotonic() < deadline and body is None:
            try:
                with urllib.request.urlopen(request, timeout=5) as response:
                    body = json.loads(response.read())
            except OSError:
                time.sleep(1)
        assert body is not None, "the UI did not answer within 120 s"
        (found,) = body["runs"]
        assert found["info"]["run_id"] == run.info.run_id
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as page:
            assert page.status == 200
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
