"""`raysim ui` serves the MLflow UI on 127.0.0.1 for the tracking store, runs included."""

from __future__ import annotations

import json
import os
import re
import shutil
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


def _chromium(*args: str) -> subprocess.CompletedProcess:
    """Headless Chromium (Debian's `chromium`, which `make setup` installs) on a page of the UI."""
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary, "headless Chromium is needed: `make setup` installs Debian's chromium package"
    options = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1600,1100",
               "--virtual-time-budget=20000"]  # fmt: skip
    return subprocess.run([binary, *options, *args], capture_output=True, text=True, timeout=180)


def _page_text(url: str) -> list[str]:
    """The rendered page's visible text, one string per element."""
    html = _chromium("--dump-dom", url).stdout
    return [part.strip() for part in re.sub(r"<[^>]+>", "\n", html).splitlines() if part.strip()]


@pytest.mark.slow
def test_screenshots_show_the_runs_table_and_a_run_whose_first_charts_are_the_curves(tmp_path):
    """A user runs an experiment, starts `raysim ui` and opens the link it prints: the runs table in MLflow's
    model-training view; the run's metric charts start with the PM/GM/HM sections (accuracy first), the
    summaries sit beside their curves, and the secondary sections follow."""
    from tests.conftest import tiny_config
    from tests.test_cli import _raysim, _write

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = _write(tmp_path, tiny_config(rounds=2, tracking={"uri": uri, "experiment": "screens"}))
    done = _raysim("run", str(config), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("screens").experiment_id])
    port = _free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", "ui", "--tracking-uri", uri, "--port", str(port)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        link = next(line.split(" ", 1)[1].strip() for line in process.stdout if line.startswith("open "))
        assert link.startswith(f"http://127.0.0.1:{port}/#/experiments/") and "workflowType=machine_learning" in link
        deadline = time.monotonic() + 120
        while not _healthy(port) and time.monotonic() < deadline:
            time.sleep(1)
        runs_shot, run_shot = tmp_path / "runs.png", tmp_path / "run.png"
        _chromium(f"--screenshot={runs_shot}", link)
        table = _page_text(link)
        assert run.info.run_name in table and "Model training" in table and "Runs" in table
        run_page = link.replace("/runs?", f"/runs/{run.info.run_id}/model-metrics?")
        _chromium(f"--screenshot={run_shot}", run_page)
        text = _page_text(run_page)
        sections = [name for name, count in zip(text, text[1:], strict=False) if re.fullmatch(r"\(\d+\)", count)]
        assert sections[:3] == ["gm", "hm", "pm"], sections
        assert {"update", "traffic", "round", "time", "server"} <= set(sections[3:])
        assert not any(name.startswith(("best", "final")) for name in sections)
        for shot in (runs_shot, run_shot):
            assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 30_000
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False
