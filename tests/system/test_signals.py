"""Signals as users send them to real `raysim` processes: Ctrl-C (SIGINT to the process group, as a terminal
does), SIGTERM and SIGHUP to the driver's PID or to its whole process group (`kill`, `kill -- -PGID`, a batch
scheduler, a container stop, a closed terminal), SIGKILL of the driver, the local Ray's GCS server or raylet
killed under a run; and SIGTERM to `raysim ui` and `raysim server`, which must not leave the MLflow server
holding its port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.config import validate_config
from raysim.errors import Interrupted, raise_pending, sigterm_interrupts
from raysim.runtime.driver import run_experiment
from raysim.studies.procmem import descendants
from tests.support.cluster import free_port
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.logged import check_logged, points
from tests.support.stores import fresh_store
from tests.support.terminal import sigint_as_from_a_terminal

RAYSIM = str(Path(sys.executable).parent / "raysim")


class _RaisesInDel:
    """Sends this process `number` from its __del__, whose code then runs on: Python runs the signal's handler in
    there and drops what it raises ("Exception ignored in ..."), as it did in a weakref callback of a CI run whose
    Ctrl-C was lost."""

    def __init__(self, number: int):
        self.number = number

    def __del__(self) -> None:
        os.kill(os.getpid(), self.number)
        for _ in range(10_000):
            pass


def test_an_interruption_python_dropped_is_raised_at_the_next_check():
    with sigterm_interrupts():
        _RaisesInDel(signal.SIGHUP)  # freed at once: the handler's Interrupted is dropped inside __del__
        with pytest.raises(Interrupted) as raised:
            raise_pending()
        assert raised.value.signal_number == signal.SIGHUP
        raise_pending()  # raised once only


def test_ctrl_c_is_handled_like_sigterm_unless_it_is_ignored():
    """A background job ignores SIGINT (as a non-interactive shell starts it): it keeps ignoring it."""
    original = signal.getsignal(signal.SIGINT)
    try:
        for before, replaced in ((signal.default_int_handler, True), (signal.SIG_IGN, False)):
            signal.signal(signal.SIGINT, before)
            with sigterm_interrupts():
                assert (signal.getsignal(signal.SIGINT) is not before) == replaced
            assert signal.getsignal(signal.SIGINT) is before
    finally:
        signal.signal(signal.SIGINT, original)


def _signals_config(tmp_path: Path, uri: str, rounds: int) -> dict:
    """A tiny experiment on a local Ray of 2 CPUs, checkpointed every round into tmp_path/ck: one host (the signals
    reach the driver and the local Ray's daemons; a second host was one more process importing torch per run)."""
    return tiny_config(
        rounds=rounds,
        runtime={"num_hosts": 1, "num_cpus": 2},
        tracking={"experiment": "signals", "uri": uri, "checkpoint_every": 1, "checkpoint_dir": str(tmp_path / "ck")},
    )


def _start_run(tmp_path: Path, rounds: int = 10_000, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`raysim run` of a long tiny experiment with a checkpoint every round, in its own process group (in `env`,
    else this process's environment); returns once a checkpoint of round 2 or later is complete."""
    driver, uri = _launch_run(tmp_path, rounds, env)
    _wait_for_checkpoint(driver, tmp_path, 2)
    return driver, uri


def _launch_run(tmp_path: Path, rounds: int, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """`_start_run`'s `raysim run`, returned at once (the test does something else while it starts)."""
    uri = fresh_store(tmp_path / "mlflow.db")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_signals_config(tmp_path, uri, rounds)))
    return _start(tmp_path, "run", str(tmp_path / "run.yaml"), env=env), uri


def _start(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """`raysim ARGS` in its own process group, SIGINT not ignored, its stderr into tmp_path/stderr.txt."""
    with open(tmp_path / "stderr.txt", "w") as stderr:  # a file: a pipe nobody reads would fill and block
        return subprocess.Popen(
            [RAYSIM, *args],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            env=env,
            start_new_session=True,
            preexec_fn=sigint_as_from_a_terminal,
        )


def _wait_for_checkpoint(driver: subprocess.Popen, tmp_path: Path, at_least: int) -> None:
    """Until a checkpoint of round `at_least` or later is complete under tmp_path/ck (a local Ray started twice, its
    first try 30 s in vain, included)."""
    deadline = time.monotonic() + 300
    while _newest_checkpoint(tmp_path / "ck") < at_least:
        if driver.poll() is not None or time.monotonic() > deadline:
            driver.kill()
            raise AssertionError(f"run did not reach round {at_least}: {_stderr(tmp_path)[-2000:]}")
        time.sleep(0.05)


def _stderr(tmp_path: Path) -> str:
    return (tmp_path / "stderr.txt").read_text()


def _alive(pids: list[int]) -> list[int]:
    """The processes of `pids` still running (zombies awaiting their reaper do not count)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != "Z":
            alive.append(pid)
    return alive


def _run_record(uri: str):
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("signals").experiment_id])
    return run


def _wait_all_gone(pids: list[int]) -> None:
    deadline = time.monotonic() + 30  # Ray's workers notice their raylet is gone within seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pids), "processes of the run left behind"


@pytest.mark.slow
@pytest.mark.parametrize(
    "sig", [signal.SIGINT, signal.SIGHUP], ids=["SIGINT-group", "SIGHUP-group"]
)  # to the PID alone: test_a_run_stopped_by_sigint_then_sigterm_to_its_pid_resumes_to_the_same_run
def test_interrupted_run_is_marked_killed_with_one_line(tmp_path, sig):
    """To the whole group (Ctrl-C, `kill -- -PGID`, a scheduler, a container stop, a closed terminal) the signal
    reaches the local Ray's daemons too unless they run apart: they used to die under the driver, which then hung
    61 s and exited 1 with Ray's "Failed to connect to GCS" line, leaving the run RUNNING."""
    driver, uri = _start_run(tmp_path)
    _interrupt(driver, tmp_path, uri, sig, to_group=True)


def _interrupt(driver: subprocess.Popen, tmp_path: Path, uri: str, sig: signal.Signals, to_group: bool) -> int:
    """Sends `sig` to the driver's process group or its PID alone; the run must end KILLED with one line, exit
    128 + sig, within a minute, leaving none of its processes. Returns the round the line says it stopped after."""
    started = descendants(driver.pid)  # the driver, the local Ray it started, its actors
    assert len(started) > 3
    sent = time.monotonic()
    if to_group:
        os.killpg(driver.pid, sig)
    else:
        os.kill(driver.pid, sig)
    driver.wait(timeout=120)
    took = time.monotonic() - sent
    err = _stderr(tmp_path)
    assert driver.returncode == 128 + sig, err[-2000:]
    assert "Traceback" not in err and "GCS" not in err, err[-3000:]
    run = _run_record(uri)
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"run {run.info.run_id} interrupted by {sig.name} after round "), last
    assert last.endswith(f"marked KILLED; continue with `raysim resume {run.info.run_id}`"), last
    assert run.info.status == "KILLED"
    assert run.data.tags["raysim.error"].startswith(f"interrupted by {sig.name}")
    assert took < 60, f"{took:.0f} s from the signal to the exit"  # Ray ends a driver 60 s after losing its GCS
    _wait_all_gone(started)
    return int(last.split(" after round ", 1)[1].split()[0].rstrip(";:,"))


SLOW_AGENT = """
import os, sys, time
from pathlib import Path

marker = Path(os.environ["RAYSIM_TEST_SLOW_AGENT"])
if any(arg.endswith(os.path.join("dashboard", "agent.py")) for arg in sys.argv) and not marker.exists():
    marker.write_text(str(os.getpid()))
    time.sleep(120)
"""
"""A sitecustomize that holds up the first Ray dashboard agent started under it, as a loaded machine does: the
raylet waits a fixed time for the agent's port files, exits, and ray.init says "The current node timed out during
startup" (ray-project/ray#65983)."""


@pytest.mark.slow
def test_a_run_stopped_by_sigint_then_sigterm_to_its_pid_resumes_to_the_same_run(tmp_path, ray_local, capsys):
    """SIGINT, then SIGTERM, to the PID of `raysim run` alone (`kill -INT PID`, `kill PID`: the local Ray's daemons
    get nothing), the second during `raysim resume`: each stops the run KILLED with one line and keeps its rounds;
    the last `raysim resume` (in this process, on the session's Ray: no signal is its subject) finishes it with
    every metric point logged once, the points logged before each stop unchanged, and the results of an
    uninterrupted run (issue 51.4). The first local Ray of `raysim run` has a dashboard agent 120 s late
    (SLOW_AGENT): the run starts it again after ending what the failed try started (the late agent among it), says
    so on the console, and goes on to the same results (what test_a_local_ray_whose_agent_starts_late_is_started_again
    checked in a run of its own). The uninterrupted run the results are compared with runs in this process while
    `raysim run` waits out Ray's 30 s for its first, late try."""
    rounds = 30
    marker = tmp_path / "late-agent-pid"
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(SLOW_AGENT)
    path = os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")]))
    late = {**os.environ, "PYTHONPATH": path, "RAYSIM_TEST_SLOW_AGENT": str(marker)}
    driver, uri = _launch_run(tmp_path, rounds, env=late)
    data = _signals_config(tmp_path / "fresh", fresh_store(tmp_path / "fresh" / "m.db"), rounds)
    data["runtime"] = IN_PROCESS  # the same results as hosts on Ray (tests/integration/test_matrix_on_ray.py)
    fresh = run_experiment(validate_config(data), show_progress=False)
    uninterrupted = _histories(data["tracking"]["uri"], fresh.run_id)
    _wait_for_checkpoint(driver, tmp_path, 2)
    client = MlflowClient(uri)
    first = _interrupt(driver, tmp_path, uri, signal.SIGINT, to_group=False)
    err = _stderr(tmp_path)
    assert "the local Ray did not start in time (try 1 of 3" in err, err[-3000:]
    assert marker.exists(), "the agent was not held up: the test tested nothing"
    _wait_all_gone([int(marker.read_text())])
    run_id = _run_record(uri).info.run_id
    kept = _histories(uri, run_id)
    assert first < rounds and [step for step, _ in kept["pm/acc"]] == list(range(first + 1))

    resumed = _start(tmp_path, "resume", run_id, "--tracking-uri", uri, "--quiet")
    _wait_for_checkpoint(resumed, tmp_path, first + 2)
    second = _interrupt(resumed, tmp_path, uri, signal.SIGTERM, to_group=False)
    assert first < second < rounds
    again = _histories(uri, run_id)
    assert {key: history[: len(kept.get(key, []))] for key, history in again.items()} == kept  # nothing lost

    capsys.readouterr()
    assert main(["resume", run_id, "--tracking-uri", uri, "--quiet"]) == 0, capsys.readouterr().err[-3000:]
    assert _run_record(uri).info.status == "FINISHED"
    check_logged(client, run_id, _signals_config(tmp_path, uri, rounds))
    final = _histories(uri, run_id)
    assert {key: history[: len(again[key])] for key, history in final.items() if key in again} == again
    for key in ("pm/acc", "gm/acc", "hm/acc", "pm/loss", "gm/loss", "hm/loss"):
        assert final[key] == uninterrupted[key], key


def _histories(uri: str, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """Every metric point of the run but MLflow's system metrics: key -> (step, value) in step order."""
    return {key: history for key, history in points(uri)[run_id].items() if not key.startswith("system/")}


@pytest.mark.slow
def test_sigterm_while_the_local_ray_starts_is_one_line(tmp_path):
    """ray.init installs a SIGTERM handler of its own that exits on the spot (SystemExit 15, a traceback through
    raysim); a SIGTERM while Ray starts ends like any other: one line, exit 143, nothing left running."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(tiny_config(rounds=10_000, tracking={"uri": uri})))
    with open(tmp_path / "stderr.txt", "w") as stderr:
        driver = subprocess.Popen(
            [RAYSIM, "run", str(tmp_path / "run.yaml"), "--quiet"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 180
        while not [p for p in descendants(driver.pid) if _comm(p) == "gcs_server"]:
            assert driver.poll() is None and time.monotonic() < deadline, _stderr(tmp_path)[-2000:]
            time.sleep(0.05)
        started = descendants(driver.pid)
        os.kill(driver.pid, signal.SIGTERM)
        driver.wait(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
    err = _stderr(tmp_path)
    assert driver.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last == "interrupted by SIGTERM before the run started" or last.startswith("run "), last
    assert "interrupted by SIGTERM" in last, last
    _wait_all_gone(started)


@pytest.mark.slow
def test_a_closed_terminal_ends_the_run_killed(tmp_path):
    """The real thing behind SIGHUP: `raysim run` on a terminal (a pty whose slave is its controlling terminal,
    with the live progress bar), and the terminal closed. The kernel hangs up the session; the run is marked
    KILLED, exit 129, although nothing can be printed any more."""
    import fcntl
    import select
    import termios
    import threading

    uri = fresh_store(tmp_path / "mlflow.db")
    tracking = {"experiment": "signals", "uri": uri, "checkpoint_every": 1, "checkpoint_dir": str(tmp_path / "ck")}
    (tmp_path / "run.yaml").write_text(
        yaml.safe_dump(tiny_config(rounds=10_000, runtime={"num_hosts": 1}, tracking=tracking))
    )
    master, terminal = os.openpty()

    def controlling_terminal() -> None:  # after setsid: the pty becomes the session's terminal, as in a login
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)
        sigint_as_from_a_terminal()

    driver = subprocess.Popen(
        [RAYSIM, "run", str(tmp_path / "run.yaml")],
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
        preexec_fn=controlling_terminal,
    )
    os.close(terminal)
    shown, closing = bytearray(), threading.Event()

    def read_terminal() -> None:  # what a terminal does: read everything, so the program never blocks writing
        while not closing.is_set():
            if select.select([master], [], [], 0.2)[0]:
                try:
                    shown.extend(os.read(master, 65536))
                except OSError:
                    break
        os.close(master)  # the terminal window closes: the kernel sends the session SIGHUP

    reader = threading.Thread(target=read_terminal)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while _newest_checkpoint(tmp_path / "ck") < 2:
            assert driver.poll() is None and time.monotonic() < deadline, shown.decode(errors="replace")[-2000:]
            time.sleep(0.05)
        started = descendants(driver.pid)
        closing.set()
        reader.join()
        driver.wait(timeout=120)
    finally:
        closing.set()
        if driver.poll() is None:
            driver.kill()
    assert b"Traceback" not in shown
    seen = shown.decode(errors="replace")[-2000:]
    run = _run_record(uri)
    assert (driver.returncode, run.info.status) == (128 + signal.SIGHUP, "KILLED"), seen
    assert run.data.tags["raysim.error"].startswith("interrupted by SIGHUP after round ")
    _wait_all_gone(started)


def _newest_checkpoint(folder: Path) -> int:
    """The newest complete checkpoint's round (0 if none): only the newest two are kept, so a fast run may have
    deleted any given round's before a poll sees it."""
    return max((int(m.parent.name[6:]) for m in folder.glob("*/round-*/manifest.json")), default=0)


def _daemon(driver_pid: int, name: str) -> int:
    """The pid of the local Ray's `name` process (gcs_server, raylet) the driver started."""
    (pid,) = [p for p in descendants(driver_pid) if _comm(p) == name]
    return pid


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("daemon", ["gcs_server", "raylet"])
def test_a_run_that_loses_its_local_ray_is_marked_failed_with_one_line(tmp_path, daemon):
    """The GCS server or raylet killed under a run (by hand, by the OOM killer): the run is FAILED with its tag
    and one `error:` line, exit 1, well before Ray would end the driver (60 s after losing the GCS)."""
    driver, uri = _start_run(tmp_path)
    started = descendants(driver.pid)
    pid = _daemon(driver.pid, daemon)
    sent = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    driver.wait(timeout=120)
    took = time.monotonic() - sent
    err = _stderr(tmp_path)
    run = _run_record(uri)
    name = {"gcs_server": "GCS server", "raylet": "raylet"}[daemon]
    lost = f"the local Ray is gone: its {name} (pid {pid}) was killed by SIGKILL"
    assert driver.returncode == 1, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: run {run.info.run_id} failed after round ") and lost in last, last
    assert last.endswith(f"marked FAILED; continue with `raysim resume {run.info.run_id}`"), last
    assert run.info.status == "FAILED"
    assert run.data.tags["raysim.error"].startswith(lost + " after round ")
    assert took < 50, f"{took:.0f} s from the kill to the exit"
    _wait_all_gone(started)


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return True
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("command", ["ui", "server"])
def test_sigterm_stops_the_mlflow_server_and_frees_its_port(tmp_path, command):
    port = free_port()
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = (
        ["--tracking-uri", uri]
        if command == "ui"
        else ["--backend-store-uri", uri, "--artifacts-destination", str(tmp_path / "artifacts")]
    )
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [RAYSIM, command, "--port", str(port), *store], cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=stderr
        )
    try:
        deadline = time.monotonic() + 120
        while not _listening(port):
            assert process.poll() is None and time.monotonic() < deadline, _stderr(tmp_path)[-2000:]
            time.sleep(0.1)
        started = descendants(process.pid)
        assert len(started) > 1  # the MLflow server and its workers
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        process.kill()
    err = _stderr(tmp_path)
    assert process.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
    assert not _listening(port)
    assert not _alive(started), "server processes left"
