"""`raysim ui` serves the MLflow UI on 127.0.0.1 for the tracking store, runs included: on the next free port when
5000 is taken, refusing a `--port` that is taken, and in one `error:` line when MLflow does not come up."""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from tests.support.cluster import free_port

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
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(port), when], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
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
        done = subprocess.run(
            [sys.executable, "-m", "raysim.cli", command, "--port", str(port), *store],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
        )
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
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        moved, serving, link = (process.stdout.readline().strip() for _ in range(3))
        found = re.fullmatch(
            r"port 5000 on 127\.0\.0\.1 is in use(?P<by> by pid \d+: .*)?: the UI takes port (\d+)", moved
        )
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
        assert (
            group != process.pid
            and b"-m\0raysim.tracking.mlflow_server\0" in Path(f"/proc/{group}/cmdline").read_bytes()
        )
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        _stop(holder)
    assert process.returncode == 143
    assert not port_in_use("127.0.0.1", port)


@pytest.mark.slow
def test_ui_exits_in_one_line_when_mlflow_does_not_come_up(tmp_path, capsys, monkeypatch):
    """A process takes the port after raysim checked it and before MLflow binds it, and answers /health like a
    server: MLflow fails with "address already in use", raysim is not fooled by the other server's answers,
    prints no link and exits 2 with one line naming what happened and who holds the port. `raysim ui` runs in this
    process (its command line's code; the MLflow server is a real process of its own, the subject)."""
    from raysim.cli import main

    monkeypatch.chdir(tmp_path)
    port = free_port()
    holder, _ = _hold(port, "after-mlflow-starts")
    try:
        code = main(["ui", "--port", str(port), "--tracking-uri", f"sqlite:///{tmp_path / 'mlflow.db'}"])
        assert holder.stdout.readline().strip() == "listening"
    finally:
        _stop(holder)
    out, err = capsys.readouterr()
    assert code == 2 and "http://" not in out, out
    (line,) = err.splitlines()
    assert line.startswith(f"error: MLflow server on http://127.0.0.1:{port} exited with code "), line
    assert "address already in use" in line and f"is in use by pid {holder.pid}: " in line, line
    log = Path(re.search(r"\(log: (\S+)\)$", line)[1])
    assert "address already in use" in log.read_text()  # kept, and named, for a server that failed
    log.unlink()


def test_a_chosen_port_taken_while_mlflow_starts_moves_the_server_to_the_next_free_one(tmp_path, capsys):
    """Two UIs started at once both find the same port free: the one that loses the race says so in one line
    and serves on the next free port, where a port given with --port fails as above."""
    from raysim.tracking.server import PortTaken, ServerSettings, _start_on_a_free_port

    port = free_port()
    holder, _ = _hold(port, "after-mlflow-starts")
    settings = ServerSettings(f"sqlite:///{tmp_path / 'mlflow.db'}", None, "127.0.0.1", port)
    try:
        server = _start_on_a_free_port(settings, port_chosen=True)
        try:
            assert server.settings.port != port
            assert urllib.request.urlopen(f"{server.settings.url}/health", timeout=30).status == 200
        finally:
            server.stop()
        assert holder.stdout.readline().strip() == "listening"
        moved = capsys.readouterr().out
        assert f"port {port} on 127.0.0.1 is in use by pid {holder.pid}" in moved, moved
        assert f"the server takes port {server.settings.port}" in moved, moved
        with pytest.raises(PortTaken, match=f"port {port} on 127.0.0.1 is in use"):
            _start_on_a_free_port(settings, port_chosen=False)
    finally:
        _stop(holder)


CHROMIUM_WAIT_S = 180
"""The longest a page's answer from Chromium may take (its 20 s of virtual time included)."""


class _Chromium:
    """One headless Chromium (Debian's `chromium`, which `make setup` installs) for every page of a test, driven over
    `--remote-debugging-pipe` with the Chrome DevTools protocol (JSON messages ending in NUL, commands on the
    browser's fd 3, answers and events on its fd 4): each start costs seconds of CPU, and the later pages load
    MLflow's JavaScript from the warm browser's cache."""

    def __init__(self) -> None:
        binary = shutil.which("chromium") or shutil.which("chromium-browser")
        assert binary, "headless Chromium is needed: `make setup` installs Debian's chromium package"
        options = ["--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--remote-debugging-pipe"]
        commands, self._commands = os.pipe()
        self._answers, answers = os.pipe()
        pipe_ends = commands, answers
        # the browser's ends renumbered past 4, so that moving them to 3 and 4 closes neither (bash, not dash, takes
        # the numbers past 9 that they may have)
        commands, answers = (fcntl.fcntl(fd, fcntl.F_DUPFD, 5) for fd in (commands, answers))
        self.process = subprocess.Popen(
            ["bash", "-c", f'exec "$@" 3<&{commands} 4>&{answers}', "bash", binary, *options],
            pass_fds=(commands, answers),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for fd in (commands, answers, *pipe_ends):
            os.close(fd)
        self._unread, self._sent, self._events = b"", 0, []

    def call(self, method: str, session: str | None = None, **params) -> dict:
        self._sent += 1
        message = {"id": self._sent, "method": method, "params": params, **({"sessionId": session} if session else {})}
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        answer = self._next(lambda message: message.get("id") == self._sent)
        assert "error" not in answer, (method, answer)
        return answer["result"]

    def _next(self, wanted) -> dict:
        """The first message that is `wanted`, an event received earlier included; others are kept. Within
        CHROMIUM_WAIT_S, as each page's Chromium process had."""
        for message in self._events:
            if wanted(message):
                self._events.remove(message)
                return message
        deadline = time.monotonic() + CHROMIUM_WAIT_S
        while True:
            while b"\0" not in self._unread:
                ready, _, _ = select.select([self._answers], [], [], max(0.0, deadline - time.monotonic()))
                assert ready, f"Chromium answered nothing within {CHROMIUM_WAIT_S} s"
                block = os.read(self._answers, 1 << 20)
                assert block, "Chromium closed its DevTools pipe"
                self._unread += block
            raw, self._unread = self._unread.split(b"\0", 1)
            message = json.loads(raw)
            if wanted(message):
                return message
            self._events.append(message)

    def render(self, url: str, shot: Path | None = None, width: int = 1600) -> str:
        """The rendered page's DOM, and its screenshot in `shot` when given, from a new tab of `width` x 1100 pixels
        (MLflow draws a grouped chart only when the window is wide enough for its card: 1900 pixels), once 20 s of
        virtual time have passed without a network fetch pending (as `--virtual-time-budget=20000` waits)."""
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        tab = self.call("Target.attachToTarget", targetId=target, flatten=True)["sessionId"]
        self.call(
            "Emulation.setDeviceMetricsOverride", tab, width=width, height=1100, deviceScaleFactor=1, mobile=False
        )
        self.call("Emulation.setVirtualTimePolicy", tab, policy="pause")  # the budget counts from the navigation
        self.call("Page.navigate", tab, url=url)
        self.call("Emulation.setVirtualTimePolicy", tab, policy="pauseIfNetworkFetchesPending", budget=20000)
        self._next(lambda message: message.get("method") == "Emulation.virtualTimeBudgetExpired")
        html = self.call("Runtime.evaluate", tab, expression="document.documentElement.outerHTML", returnByValue=True)
        if shot:
            shot.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", tab, format="png")["data"]))
        self.call("Target.closeTarget", targetId=target)
        self._events.clear()  # the closed tab's
        return html["result"]["value"]

    def __enter__(self) -> _Chromium:
        return self

    def __exit__(self, *_: object) -> None:
        with contextlib.suppress(AssertionError, OSError):
            self.call("Browser.close")
        os.close(self._commands)
        os.close(self._answers)
        self.process.wait(timeout=60)


def _text(html: str) -> list[str]:
    """A rendered page's visible text, one string per element."""
    return [part.strip() for part in re.sub(r"<[^>]+>", "\n", html).splitlines() if part.strip()]


@pytest.mark.slow
def test_screenshots_compare_a_suite_and_show_a_run_whose_first_charts_are_the_curves(tmp_path, capsys, monkeypatch):
    """A user runs a suite and starts the MLflow UI with the command its first lines print. The comparison view shows
    every child (not the first ten) and no group of the parent run ("Additional runs"), grouped by setting (best
    mean PM accuracy first) with each child's global model (a LoggedModel) and its mean accuracies as columns, each
    group in the colour its children carry and `raysim figure` draws, and charts each setting's mean PM/GM/HM
    curves; the parent run's description links to it. The experiment's runs table opens in
    MLflow's model-training view; a run's metric charts start with the PM/GM/HM sections (accuracy first), the
    summaries beside their curves, the secondary sections after. `--compare` on a run that is no study's parent is
    one error line."""
    import yaml

    from raysim.cli import main
    from raysim.studies.figure import curves_figure
    from raysim.tracking.plots import mlflow_group_color
    from raysim.tracking.server import runs_page
    from tests.support.experiments import IN_PROCESS, tiny_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    base = tiny_config(
        rounds=2,
        clients={"count": 3},
        runtime=IN_PROCESS,  # what MLflow's UI shows is the subject, not Ray's hosts
        tracking={"uri": uri, "experiment": "compared", "save_models": "global"},
    )
    settings = ["fedavg", "fedprox", "ditto"]
    runs = [{"name": name, "set": {"algorithm": {"name": name, "lr": 0.05}}} for name in settings]
    suite = tmp_path / "suite.yaml"
    suite.write_text(yaml.safe_dump({"name": "three", "base": base, "runs": runs, "seeds": [0, 1]}))
    monkeypatch.chdir(tmp_path)  # the suite runs in this process: the UI's view of it is the subject
    assert main(["run", str(suite)]) == 0
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err, printed.err[-2000:]
    command = next(line.split(": ", 1)[1] for line in printed.out.splitlines() if "compare its children" in line)
    parent = command.rsplit(" ", 1)[1]
    assert command == f"raysim ui --tracking-uri {uri} --compare {parent}"
    client = MlflowClient(uri)
    experiment = client.get_run(parent).info.experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    assert sorted(r.data.tags["raysim.group"] for r in children) == sorted(settings * 2)
    colors = {name: mlflow_group_color(name) for name in settings}  # MLflow's grouped charts colour each setting so
    assert all(r.data.tags["mlflow.runColor"] == colors[r.data.tags["raysim.group"]] for r in children)
    figure = curves_figure(uri, parent)  # `raysim figure` draws each setting in that colour too
    assert all({line.get_label(): line.get_color() for line in axis.get_lines()} == colors for axis in figure.axes)
    models = client.search_logged_models([experiment])  # each child's global model, a LoggedModel of the child
    assert sorted(m.source_run_id for m in models if m.name == "global_model") == sorted(
        r.info.run_id for r in children
    )

    assert main(["ui", "--tracking-uri", uri, "--compare", children[0].info.run_id]) == 2
    assert capsys.readouterr().err.strip().endswith("is not the parent run of a suite or sweep")
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "raysim.cli", "ui", *command.split()[2:], "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    try:
        link = next(line.split(" ", 1)[1].strip() for line in process.stdout if line.startswith("open "))
        server = f"http://127.0.0.1:{port}"
        assert link == (
            f"{server}/#/experiments/{experiment}/runs?viewStateShareKey={parent}"
            "&workflowType=machine_learning&compareRunsMode=CHART"
        )
        deadline = time.monotonic() + 120
        while not _healthy(port) and time.monotonic() < deadline:
            time.sleep(1)
        shots = {name: tmp_path / f"{name}.png" for name in ("compared", "table", "runs", "run")}
        with _Chromium() as browser:  # one browser for every page
            page = browser.render(link, shots["compared"], width=1900)
            text = _text(page)
            assert all(f"Group: {name}" in text for name in settings), text
            assert "Additional runs" not in text and "Sort: pm/acc" in text  # no group of the parent run beside them
            dots = [f"rgb{tuple(int(color[i : i + 2], 16) for i in (1, 3, 5))}" for color in colors.values()]
            assert all(dot in page for dot in dots), dots  # each group's colour swatch
            assert "Model training" in text and not {"Judges", "Prompts"} & set(text)  # not MLflow's GenAI view
            sections = [name for name, count in zip(text, text[1:], strict=False) if re.fullmatch(r"\(\d+\)", count)]
            assert sections == ["gm", "hm", "pm"], sections  # the headline curves, not the parent's means
            table_link = link.replace("&compareRunsMode=CHART", "")
            table = _text(browser.render(table_link, shots["table"], width=1900))
            assert {"pm/acc", "gm/acc", "hm/acc"} <= set(table) and all(r.info.run_name in table for r in children)
            assert table.count("global_model") == len(children), table  # the Models column: each child's LoggedModel
            description = browser.render(f"{server}/#/experiments/{experiment}/runs/{parent}")
            assert f'href="{link.removeprefix(server).replace("&", "&amp;")}"' in description

            runs_link = runs_page(server, uri, "compared")
            assert runs_link == f"{server}/#/experiments/{experiment}/runs?workflowType=machine_learning"
            table = _text(browser.render(runs_link, shots["runs"]))
            assert "three" in table and "Model training" in table and "Runs" in table
            run_page = runs_link.replace("/runs?", f"/runs/{children[0].info.run_id}/model-metrics?")
            text = _text(browser.render(run_page, shots["run"]))
            sections = [name for name, count in zip(text, text[1:], strict=False) if re.fullmatch(r"\(\d+\)", count)]
            assert sections[:3] == ["gm", "hm", "pm"], sections
            assert {"update", "traffic", "round", "time", "server"} <= set(sections[3:])
            assert not any(name.startswith(("best", "final")) for name in sections)
        for shot in shots.values():
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
