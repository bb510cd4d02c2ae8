"""`raysim ui` serves the MLflow UI on 127.0.0.1 for the tracking store, runs included: on the next free port when
5000 is taken, refusing a `--port` that is taken, and in one `error:` line when MLflow does not come up."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.cluster import free_port

HOLD = """
import http.server, os, sys, time
port, when = int(sys.argv[1]), sys.argv[2]
def mlflow_starting():
    wanted = f"--port\\0{port}\\0".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            line = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if b"mlflow" in line and b"server" in line and wanted in line:
            return True
    return False
print("waiting", flush=True)
while when == "after-mlflow-starts" and not mlflow_starting():
    time.sleep(0.02)
class Healthy(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"OK")
    def log_message(self, *args):
        pass
try:
    server = http.server.HTTPServer(("127.0.0.1", port), Healthy)
except OSError:
    print("taken", flush=True)
    sys.exit(0)
print("listening", flush=True)
server.serve_forever()
"""


def _hold(port: int, when: str = "now") -> tuple[subprocess.Popen, bool]:
    """A real process that listens on 127.0.0.1:`port` and answers every GET with 200 (like a healthy MLflow):
    at once, or (`after-mlflow-starts`) as soon as an `mlflow server --port PORT` process exists, i.e. between
    raysim's check of the port and MLflow binding it. Also whether it got the port at once (False: someone had
    it already)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(port), when], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)  # fmt: skip
    assert holder.stdout.readline().strip() == "waiting"
    return holder, when == "now" and holder.stdout.readline().strip() == "listening"


def _stop(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    process.wait(timeout=60)


@pytest.mark.parametrize("command", ["ui", "server"])
def test_a_port_given_and_taken_is_refused_in_one_line_naming_its_holder(command, tmp_path):
    port = free_port()
    holder, held = _hold(port)
    assert held
    store = ["--tracking-uri" if command == "ui" else "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    try:
        done = subprocess.run([sys.executable, "-m", "raysim.cli", command, "--port", str(port), *store],
                              cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    finally:
        _stop(holder)
    assert done.returncode == 2 and done.stdout == "", done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: port {port} on 127.0.0.1 is in use by pid {holder.pid}: {sys.executable} -c")
    assert line.endswith("choose another --port, or stop it")
    assert not list(tmp_path.iterdir())  # refused before anything started: no store made


@pytest.mark.parametrize("command", ["ui", "server"])
def test_an_address_other_than_loopback_is_warned_about_first(command, tmp_path, capsys):
    """`--host 0.0.0.0` (a shared machine) is served, with a warning before anything else; loopback names are not
    warned about. The port is held here, so that the command stops right after its checks."""
    from raysim.cli import main
    from raysim.tracking.server import exposure_warning

    assert [exposure_warning(host) for host in ("127.0.0.1", "localhost", "::1")] == [None, None, None]
    port = free_port()
    holder, held = _hold(port)
    assert held
    store = ["--tracking-uri" if command == "ui" else "--backend-store-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"]
    try:
        code = main([command, "--host", "0.0.0.0", "--port", str(port), *store])
    finally:
        _stop(holder)
    warning, error = capsys.readouterr().err.splitlines()
    assert code == 2 and warning == exposure_warning("0.0.0.0")
    assert warning.startswith("warning: --host 0.0.0.0 lets every machine") and f"port {port}" in error


@pytest.mark.slow
def test_ui_takes_the_next_free_port_when_5000_is_taken_and_serves_the_runs_of_the_store(tmp_path, mlflow_uri):
    """No --port and 5000 taken (by a process of this test, or by someone else already): the UI says so and
    serves on the next free port; the link is printed only once the UI answers there; SIGTERM stops it and
    frees the port."""
    from raysim.tracking.server import listening_pids, port_in_use

    client = MlflowClient(mlflow_uri)
    experiment = client.create_experiment("ui-check")
    run = client.create_run(experiment, run_name="visible")
    client.log_metric(run.info.run_id, "pm/acc", 0.5, step=1)
    holder, held = _hold(5000)
    process = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", "ui", "--tracking-uri", mlflow_uri],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        moved, serving, link = (process.stdout.readline().strip() for _ in range(3))
        found = re.fullmatch(r"port 5000 on 127\.0\.0\.1 is in use(?P<by> by pid \d+: .*)?: the UI takes port (\d+)",
                             moved)  # fmt: skip
        assert found, (moved, process.stderr.read() if process.poll() is not None else "")
        port = int(found[2])
        assert port > 5000 and (not held or found["by"].startswith(f" by pid {holder.pid}: ")), moved
        assert serving.startswith(f"MLflow UI on http://127.0.0.1:{port} (backend {mlflow_uri}; log "), serving
        assert link == f"open http://127.0.0.1:{port}/#/experiments/{experiment}/runs?workflowType=machine_learning"
        request = urllib.request.Request(  # at once: the link is printed only once the UI answers
            f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [experiment]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            (found_run,) = json.loads(response.read())["runs"]
        assert found_run["info"]["run_id"] == run.info.run_id
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=30) as page:
            assert page.status == 200
        (group,) = {os.getpgid(pid) for pid in listening_pids(port)}  # the server the UI started, not the UI
        assert group != process.pid and b"mlflow\0server" in Path(f"/proc/{group}/cmdline").read_bytes()
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        _stop(holder)
    assert process.returncode == 143
    assert not port_in_use("127.0.0.1", port)


@pytest.mark.slow
def test_ui_exits_in_one_line_when_mlflow_does_not_come_up(tmp_path):
    """A process takes the port after raysim checked it and before MLflow binds it, and answers /health like a
    server: MLflow fails with "address already in use", raysim is not fooled by the other server's answers,
    prints no link and exits 2 with one line naming what happened and who holds the port."""
    port = free_port()
    holder, _ = _hold(port, "after-mlflow-starts")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "raysim.cli", "ui", "--port", str(port), "--tracking-uri",
             f"sqlite:///{tmp_path / 'mlflow.db'}"],
            cwd=tmp_path, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert holder.stdout.readline().strip() == "listening"
    finally:
        _stop(holder)
    assert done.returncode == 2 and "http://" not in done.stdout, done.stdout
    (line,) = done.stderr.splitlines()
    assert line.startswith(f"error: MLflow server on http://127.0.0.1:{port} exited with code "), line
    assert "address already in use" in line and f"is in use by pid {holder.pid}: " in line, line
    log = Path(re.search(r"\(log: (\S+)\)$", line)[1])
    assert "address already in use" in log.read_text()  # kept, and named, for a server that failed
    log.unlink()


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
    port = free_port()
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
