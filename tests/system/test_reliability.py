"""Fault tolerance: checkpoints and resume, dead actors, NaN uploads, MLflow outages (issue #8)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.config import validate_config
from raysim.runtime.actors import RecoveryError
from raysim.runtime.driver import resume_experiment, run_experiment
from tests.support.cluster import free_port
from tests.support.experiments import IN_PROCESS
from tests.support.one_process import raysim_commands
from tests.support.paths import ROOT
from tests.support.reliability import ROUNDS, baseline_run, reliability_config, steps_logged
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("system-reliability")
"""One worker runs this module's tests: its uninterrupted baseline run is made once."""


@pytest.fixture(scope="module")
def baseline(ray_local, tmp_path_factory):
    """The uninterrupted run every failure test must reproduce exactly (tests/support/reliability.py)."""
    return baseline_run(tmp_path_factory.mktemp("baseline"))


def test_killed_host_and_coordinator_are_restored_and_the_run_is_unchanged(baseline, mlflow_uri, tmp_path):
    config = validate_config(reliability_config(mlflow_uri, tmp_path))
    killed: list[str] = []

    def kill(round_index, simulation):
        targets = {1: ("host", simulation.hosts[0]), 2: ("coordinator", simulation.coordinator)}
        if round_index in targets and targets[round_index][0] not in killed:
            name, actor = targets[round_index]
            pid = ray.get(actor.pid.remote())
            os.kill(pid, signal.SIGKILL)  # a real process death, mid-run
            killed.append(name)

    result = run_experiment(config, show_progress=False, inspect=kill)
    assert killed == ["host", "coordinator"]
    assert result.summary == baseline.summary
    assert repr(result.final) == repr(baseline.final)
    steps = steps_logged(mlflow_uri, result.run_id, "time/round")
    assert sorted(steps) == list(range(1, ROUNDS + 1))


@pytest.mark.parametrize(
    ("restarts", "timeout", "message"),
    [
        (1, 0.01, r"^host 1 not back 0.01 s after dying .*runtime.restore_timeout_s"),
        (0, 300, r"^host 1 died and cannot be replaced: runtime.max_restarts=0 replacements used up"),
    ],
)
def test_restore_gives_up_naming_the_actor(ray_local, mlflow_uri, tmp_path, restarts, timeout, message):
    """A replacement host that is not restored within runtime.restore_timeout_s, or a dead host with no
    replacement left, stops the run with one line naming the host."""
    data = reliability_config(mlflow_uri, tmp_path)
    data["runtime"] = {**data["runtime"], "max_restarts": restarts, "restore_timeout_s": timeout}

    def kill(round_index, simulation):
        if round_index == 2:
            os.kill(ray.get(simulation.hosts[1].pid.remote()), signal.SIGKILL)

    started = time.monotonic()
    with pytest.raises(RecoveryError, match=message):
        run_experiment(validate_config(data), show_progress=False, inspect=kill)
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_killed_host_of_the_shipped_quickstart_is_restored(ray_local, tmp_path):
    """The shipped quickstart on Fashion-MNIST (fewer rounds): a host's client list (~280 KB) is larger than
    Ray's inline limit, so a restarted host is built from object-store arguments that must still be alive."""
    from raysim.config import load_config

    def config(name: str, *more: str):
        return load_config(
            ROOT / "configs" / "quickstart.yaml",
            [
                "rounds=4",
                "tracking.checkpoint_every=2",
                f"tracking.uri=sqlite:///{tmp_path / name}.db",
                f"tracking.checkpoint_dir={tmp_path / name}",
                "tracking.figures=[]",
                "tracking.save_models=none",
                *more,
            ],
        )

    # the uninterrupted run in process: the results Ray's hosts give (tests/integration/test_matrix_on_ray.py)
    baseline = run_experiment(config("baseline", "runtime.actors=in_process"), show_progress=False)
    killed: list[int] = []

    def kill(round_index, simulation):
        if round_index == 2 and not killed:  # round 3 is logged; the last checkpoint is round 2's
            killed.append(ray.get(simulation.hosts[0].pid.remote()))
            os.kill(killed[0], signal.SIGKILL)

    result = run_experiment(config("killed"), show_progress=False, inspect=kill)
    assert killed
    assert result.summary == baseline.summary
    assert repr(result.final) == repr(baseline.final)
    uri = f"sqlite:///{tmp_path / 'killed.db'}"  # the store the run above made
    for key in ("time/round", "pm/acc"):
        steps = steps_logged(uri, result.run_id, key)
        assert sorted(steps) == list(range(0 if key == "pm/acc" else 1, 5)), (key, steps)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict[str, dict]:
    """Every `raysim run` below that is refused before Ray starts, one after the other in one process of their own
    (tests/support/one_process.py: one import of raysim and its libraries, not seven). The silent tracking server
    (accepts connections, never answers: the slow case) listens while they run; the refused one's port has nobody
    listening."""
    silent_port, refused_port = free_port(), free_port()
    while refused_port == silent_port:
        refused_port = free_port()
    cases: dict[str, dict] = {}
    for index, (runtime, _) in enumerate(HOSTS_BEYOND):
        data = reliability_config("sqlite:///{folder}/m.db", Path("{folder}"))  # refused: no store made
        cases[f"beyond-{index}"] = {**data, "runtime": {**runtime, "num_cpus": 2}}
    for index, (uri, _) in enumerate(UNOPENABLE_STORES):
        cases[f"store-{index}"] = reliability_config(uri, Path("{folder}"))
    silent = reliability_config(f"http://127.0.0.1:{silent_port}", Path("{folder}"))
    cases["silent"] = {**silent, "tracking": {**silent["tracking"], "connect_timeout_s": 2}}
    cases["nobody"] = reliability_config(f"http://127.0.0.1:{refused_port}", Path("{folder}"))
    commands = {}
    for name, data in cases.items():
        folder = tmp_path_factory.mktemp(name)
        (folder / "cli.yaml").write_text(yaml.safe_dump(data).replace("{folder}", str(folder)))
        commands[name] = (["run", str(folder / "cli.yaml"), "--quiet"], folder)
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", silent_port))
        listening.listen()
        results = raysim_commands(commands)
    for name, result in results.items():
        result["folder"] = commands[name][1]
        result["port"] = silent_port if name == "silent" else refused_port
    return results


def _refused(result: dict) -> str:
    """The one `error:` line of a run refused before Ray (Ray would have printed its own lines on starting)."""
    assert result["code"] == 2, result["stderr"]
    assert not result["ray"], "a Ray was started"
    (line,) = result["stderr"].strip().splitlines()
    return line


HOSTS_BEYOND = [
    (
        {"host_cpus": 1000},
        r"1 hosts \(runtime.num_hosts=default, .*\) x runtime.host_cpus=1000 .* needs 1000 "
        r"CPUs but the Ray cluster has 2; lower runtime.host_cpus",
    ),
    (
        {"num_hosts": 50},
        r"6 hosts \(runtime.num_hosts=50, at most one per client\) x runtime.host_cpus=1 .* "
        r"needs 6 CPUs but the Ray cluster has 2",
    ),
]


@pytest.mark.parametrize(("runtime", "expected"), HOSTS_BEYOND)
def test_hosts_beyond_the_machine_are_refused_before_ray_or_mlflow(refusals, runtime, expected):
    result = refusals[f"beyond-{HOSTS_BEYOND.index((runtime, expected))}"]
    line = _refused(result)
    assert re.fullmatch(f"error: {expected}.*", line), line
    assert not (result["folder"] / "m.db").exists()


def test_unreachable_tracking_server_fails_fast_before_ray(refusals):
    silent, nobody = refusals["silent"], refusals["nobody"]
    line = _refused(silent)
    assert silent["seconds"] < 60, silent
    assert line.startswith(
        f"error: tracking.uri http://127.0.0.1:{silent['port']}: MLflow server not reachable within 2 s"
    ), line
    line = _refused(nobody)  # nobody listens: refused at once
    assert "not reachable" in line and "Connection refused" in line, line


def _raysim(tmp_path: Path, *args: str, env: dict[str, str]) -> subprocess.Popen:
    """`raysim ARGS` started in `tmp_path` with `env` (and none of the MLflow or Ray variables of this process)."""
    raysim = str(Path(sys.executable).parent / "raysim")
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_", "RAY_ADDRESS"))}
    return subprocess.Popen(
        [raysim, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**environment, **env},
    )


def _command_line_once_ray_is_up(process: subprocess.Popen) -> str:
    """The process's command line as the system shows it (`ps`, and Ray, which records it as the job's
    entrypoint) once its local Ray is up."""
    from raysim.studies.procmem import descendants

    deadline = time.monotonic() + 240
    while (
        process.poll() is None
        and time.monotonic() < deadline
        and not [pid for pid in descendants(process.pid) if _comm(pid) == "gcs_server"]
    ):
        time.sleep(0.05)
    return Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def _finished(process: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _files_holding(folder: Path, secrets: list[str], skip: set[Path]) -> list[str]:
    """Every file under `folder` (the tracking server's database and artifacts, the checkpoints) whose bytes hold
    one of `secrets`, raw or percent-encoded."""
    import urllib.parse

    needles = {form.encode() for secret in secrets for form in (secret, urllib.parse.quote(secret, safe=""))}
    return [
        str(path)
        for path in folder.rglob("*")
        if path.is_file() and path not in skip and any(needle in path.read_bytes() for needle in needles)
    ]


UNOPENABLE_STORES = [
    (
        "postgresql+pg8000://alice:pw@127.0.0.1/mlflow",
        "error: tracking.uri postgresql+pg8000://***@127.0.0.1/mlflow: its "
        "database driver 'pg8000' is not installed (No module named 'pg8000'); install it, or name an installed "
        "one as postgresql+DRIVER://",
    ),
    (
        "mysql+nodriver://127.0.0.1/mlflow",
        "error: tracking.uri mysql+nodriver://127.0.0.1/mlflow: not a usable database URL",
    ),
    (
        "ftp://alice:pw@127.0.0.1/mlflow",
        "error: tracking.uri ftp://***@127.0.0.1/mlflow: MLflow has no tracking store for scheme 'ftp'; allowed: ",
    ),
]


@pytest.mark.parametrize(
    ("uri", "expected"), UNOPENABLE_STORES, ids=["postgresql-without-driver", "unknown-driver", "ftp"]
)
def test_a_tracking_store_mlflow_cannot_open_is_refused_before_ray(refusals, uri, expected):
    """A traceback (a database driver not installed: pg8000, where the `postgres` extra installs psycopg) or one
    line after Ray had started (ftp://): both are known before anything starts."""
    import importlib.util

    if uri.startswith("postgresql") and importlib.util.find_spec("pg8000") is not None:
        pytest.skip("pg8000 is installed here")
    line = _refused(refusals[f"store-{UNOPENABLE_STORES.index((uri, expected))}"])
    assert line.startswith(expected), line


@pytest.mark.slow
def test_credentials_are_stored_and_printed_nowhere_wherever_they_come_from(tmp_path):
    """Passwords holding `@` (redacted only up to it before) in a config file, a --set, a --tracking-uri and the
    environment ($MLFLOW_TRACKING_URI, $MLFLOW_TRACKING_PASSWORD): none reaches the console, the tracking server's
    database (params, tags: the command line in `mlflow.source.name` and `mlflow.note.content`), its artifacts or
    the checkpoints; two real runs against a real MLflow server, side by side."""
    from raysim.tracking.server import ServerSettings, TrackingServer

    secrets = [f"pw{i}@s3cret:{i}" for i in range(5)]
    settings = ServerSettings(f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts"), port=free_port())
    host = f"127.0.0.1:{settings.port}"
    with TrackingServer(settings, tmp_path / "server.log"):
        config = tmp_path / "cli.yaml"
        one_host = {"num_hosts": 1}  # the credentials are the subject: one host, one process less importing torch
        in_file = reliability_config(f"http://alice:{secrets[0]}@{host}", tmp_path, one_host, checkpoint_every=1)
        in_file["rounds"] = 2
        config.write_text(yaml.safe_dump(in_file))
        typed = [
            "--set",
            f"tracking.uri=http://alice:{secrets[1]}@{host}",
            "--tracking-uri",
            f"http://alice:{secrets[2]}@{host}",
        ]
        environment = {"MLFLOW_TRACKING_URI": f"http://bob:{secrets[3]}@{host}", "MLFLOW_TRACKING_PASSWORD": secrets[4]}
        typed_run = _raysim(tmp_path, "run", str(config), "--quiet", *typed, env=environment)
        seen = _command_line_once_ray_is_up(typed_run)
        from_environment = {**reliability_config(None, tmp_path, checkpoint_every=1), "rounds": 2}
        del from_environment["tracking"]["uri"]
        second = tmp_path / "environment.yaml"
        second.write_text(yaml.safe_dump(from_environment))
        client = MlflowClient(settings.url)
        deadline = time.monotonic() + 240
        while client.get_experiment_by_name("tests") is None:  # made by the first run: the second finds it
            assert typed_run.poll() is None and time.monotonic() < deadline, _finished(typed_run).stderr[-2000:]
            time.sleep(0.05)
        environment_run = _raysim(  # the environment's URI is the subject here, not Ray: hosts in process
            tmp_path,
            "run",
            str(second),
            "--quiet",
            "--set",
            "runtime.actors=in_process",
            env={"MLFLOW_TRACKING_URI": f"http://bob:{secrets[3]}@{host}"},
        )
        done, again = _finished(typed_run), _finished(environment_run)  # side by side
        assert done.returncode == 0, done.stderr[-2000:]
        assert again.returncode == 0, again.stderr[-2000:]
        printed = done.stdout + done.stderr + again.stdout + again.stderr
        assert not [secret for secret in secrets if secret.split("@")[1] in seen]
        assert f"--tracking-uri http://***@{host}" in seen  # as `ps` and Ray's job table see it
        runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 2
    assert not [secret for secret in secrets if secret in printed or secret.split("@")[1] in printed], printed
    first = next(run for run in runs if "--tracking-uri" in run.data.tags["mlflow.source.name"])
    assert (
        f"--set tracking.uri=http://***@{host} --tracking-uri http://***@{host}"
        in first.data.tags["mlflow.source.name"]
    )
    assert f"--tracking-uri http://***@{host}" in first.data.tags["mlflow.note.content"]
    assert first.data.params["tracking.uri"] == f"http://***@{host}"
    stored = [value for run in runs for value in [*run.data.params.values(), *run.data.tags.values()]]
    assert not [value for value in stored for secret in secrets if secret.split("@")[1] in value]
    assert list((tmp_path / "ckpt").glob("*/round-*/manifest.json"))
    held = _files_holding(tmp_path, [secret.split("@")[1] for secret in secrets], skip={config, second})
    assert not held, held


@pytest.mark.slow
def test_raysim_resume_picks_up_after_the_driver_process_is_killed(ray_local, mlflow_uri, tmp_path, capsys):
    """Long enough (30 rounds) that the driver is surely mid-run when a checkpoint of round 3 or later appears,
    however fast rounds are; the resumed run must end exactly as an uninterrupted one (run in this process while
    the driver starts its local Ray). The killed driver's run, left RUNNING, is listed for `raysim resume` as gone
    (what test_runs_of_killed_drivers_are_listed_for_resume checked in a run of its own)."""
    rounds = 30
    data = reliability_config(mlflow_uri, tmp_path, checkpoint_every=1) | {"rounds": rounds}
    data["runtime"] = {**data["runtime"], "num_hosts": 1, "num_cpus": 2}  # one host: one process less importing torch
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    raysim = str(Path(sys.executable).parent / "raysim")
    driver = subprocess.Popen(
        [raysim, "run", str(tmp_path / "run.yaml"), "--quiet"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    in_process = {**IN_PROCESS, "num_hosts": 1}  # the driver's hosts, in process
    reference = reliability_config(fresh_store(tmp_path / "reference.db"), tmp_path / "reference", in_process)
    reference["rounds"] = rounds  # in process: what Ray's hosts compute (tests/integration/test_matrix_on_ray.py)
    expected = run_experiment(validate_config(reference), show_progress=False)

    def checkpointed() -> int:
        return max(
            (int(p.parent.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("*/round-*/manifest.json")), default=0
        )

    try:
        deadline = time.monotonic() + 240
        while checkpointed() < 3:
            assert driver.poll() is None and time.monotonic() < deadline, "driver ended before round 3"
            time.sleep(0.05)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the local Ray it started: a dead driver
        driver.wait(30)
    assert checkpointed() < rounds  # killed mid-run
    run_id = next((tmp_path / "ckpt").iterdir()).name
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "RUNNING"  # nothing could catch SIGKILL
    capsys.readouterr()
    assert main(["resume", "--tracking-uri", mlflow_uri]) == 0
    (line,) = [row for row in capsys.readouterr().out.splitlines() if row.startswith(run_id)]
    assert "RUNNING" in line and f"gone ({socket.gethostname()}:{driver.pid})" in line
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.summary == expected.summary
    steps = steps_logged(mlflow_uri, run_id, "pm/acc")
    assert sorted(steps) == list(range(rounds + 1))
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
