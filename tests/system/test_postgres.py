"""MLflow on a real PostgreSQL (Debian's, started by the test as its own user in a temporary folder,
tests/support/postgres.py), reached as users write it, `postgresql://user:password@host:port/db` with the `postgres`
extra's driver: the quickstart, a suite stopped and resumed, a run whose host process is killed, and `raysim ui`,
each as the real `raysim` command, its artifacts under the named `tracking.artifact_root`, never ./mlruns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.credentials import redact
from tests.support.cli import RAYSIM
from tests.support.cluster import free_port
from tests.support.experiments import IN_PROCESS
from tests.support.paths import ROOT
from tests.support.postgres import LocalPostgres, postgres_bin
from tests.support.studies import resumable_suite, stop_during_the_second_child

pytestmark = pytest.mark.xdist_group("postgres")
"""One worker runs this module's tests: they share one PostgreSQL server (and the quickstart's run)."""


@pytest.fixture(scope="module")
def postgres():
    if postgres_bin() is None:
        pytest.skip(
            "PostgreSQL is not installed: `make tools` as root installs it (Debian: apt-get install postgresql)"
        )
    server = LocalPostgres().start()
    try:
        yield server
    finally:
        server.stop()
    assert not server.root.exists()


def _raysim(*args: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.run([*RAYSIM, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=timeout)


def _steps(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(point.step for point in client.get_metric_history(run_id, key))


def _descendants(pid: int) -> list[int]:
    """The processes below `pid` (the local Ray it started: GCS, raylet and their workers), read from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = [], {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier}
        found += frontier
    return found


def _host_processes(driver: int) -> list[int]:
    """The raysim hosts (Ray actors, `ray::ClientHost...` as the process names itself) of a driver's local Ray."""
    hosts = []
    for pid in _descendants(driver):
        try:
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::ClientHost"):
                hosts.append(pid)
        except OSError:
            continue
    return hosts


def _command_lines_holding(text: str) -> list[int]:
    """The processes whose command line (what `ps` shows every user) holds `text`."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


ROUNDS = 3


@pytest.fixture(scope="module")
def quickstart(postgres, fmnist_tenth, tmp_path_factory):
    """The shipped quickstart (on one host, an actor of a local Ray that `raysim run` starts: the store is the
    subject, and the shipped second host was one more process importing torch), 3 rounds on a tenth of
    Fashion-MNIST, checkpointed every round, run from a working folder of its own; once round 1 is checkpointed, the
    host's process is SIGKILLed (a real process death, mid-run). The run and what it printed."""
    folder = tmp_path_factory.mktemp("quickstart")
    (folder / "work").mkdir()
    uri = postgres.database("quickstart")
    settings = {
        "rounds": ROUNDS,
        "runtime.num_hosts": 1,
        "dataset.root": fmnist_tenth,
        "tracking.uri": uri,
        "tracking.artifact_root": folder / "artifacts",
        "tracking.checkpoint_every": 1,
        "tracking.checkpoint_dir": folder / "ckpt",
    }
    command = [*RAYSIM, "run", str(ROOT / "configs" / "quickstart.yaml")]
    for key, value in settings.items():
        command += ["--set", f"{key}={value}"]
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        driver = subprocess.Popen(command, cwd=folder / "work", env=env, stdout=out, stderr=err, start_new_session=True)

    def checkpointed() -> int:
        rounds = (path.parent.name.split("-")[1] for path in (folder / "ckpt").glob("*/round-*/manifest.json"))
        return max((int(r) for r in rounds), default=-1)

    killed: list[int] = []
    try:
        deadline = time.monotonic() + 600
        while checkpointed() < 1:
            assert driver.poll() is None and time.monotonic() < deadline, (folder / "stderr").read_text()
            time.sleep(0.05)
        hosts = _host_processes(driver.pid)
        assert len(hosts) == 1, hosts  # runtime.num_hosts: 1
        os.kill(hosts[0], signal.SIGKILL)
        killed.append(checkpointed())
        driver.wait(600)
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(30)
    return uri, folder, driver.returncode, killed


def _finished(quickstart) -> tuple[MlflowClient, object]:
    """The quickstart's one MLflow run, which must have finished."""
    uri, folder, code, _ = quickstart
    assert code == 0, (folder / "stderr").read_text()
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("quickstart").experiment_id])
    assert run.info.status == "FINISHED"
    return client, run


def test_the_quickstart_logs_into_postgresql_its_artifacts_under_the_named_root(postgres, quickstart):
    _, folder, _, _ = quickstart
    client, run = _finished(quickstart)
    experiment = client.get_experiment_by_name("quickstart")
    assert experiment.artifact_location == (folder / "artifacts" / "quickstart").as_uri()
    assert (folder / "stdout").read_text().splitlines()[-1].startswith(f"run {run.info.run_id}: final PM ")
    assert run.info.artifact_uri == (folder / "artifacts" / "quickstart" / run.info.run_id / "artifacts").as_uri()
    stored = folder / "artifacts" / "quickstart" / run.info.run_id / "artifacts"
    assert {"config.yaml", "clients.parquet", "convergence.png", "partition.json"} <= {p.name for p in stored.iterdir()}
    assert yaml.safe_load((stored / "config.yaml").read_text())["rounds"] == ROUNDS
    (model,) = client.search_logged_models([experiment.experiment_id])  # the global model, beside the runs
    assert (folder / "artifacts" / "quickstart" / "models" / model.model_id / "artifacts" / "MLmodel").is_file()
    assert list((folder / "work").iterdir()) == []  # no ./mlruns, ./mlartifacts or ./mlflow.db
    assert run.data.params["tracking.uri"] == redact(postgres.uri("quickstart"))
    assert redact(postgres.uri("quickstart")) == f"postgresql://***@127.0.0.1:{postgres.port}/quickstart"
    stored_text = [*run.data.params.values(), *run.data.tags.values(), (stored / "config.yaml").read_text()]
    assert not [text for text in stored_text if postgres.password in text]


def test_a_host_killed_mid_run_is_restored_and_every_round_reaches_postgresql_once(quickstart):
    """The run went back to its last checkpoint, redid the lost round and finished; the store holds each round's
    metrics once (the writer asks the store what a redone round already logged)."""
    _, folder, _, killed = quickstart
    client, run = _finished(quickstart)
    assert killed and killed[0] < ROUNDS  # before the run's end
    assert "actor lost" in (folder / "stderr").read_text()
    for key in ("pm/acc", "gm/acc", "pm/loss"):
        assert _steps(client, run.info.run_id, key) == list(range(ROUNDS + 1)), key
    assert _steps(client, run.info.run_id, "time/round") == list(range(1, ROUNDS + 1))


def test_a_new_experiment_on_postgresql_without_an_artifact_root_is_refused_in_one_line(postgres):
    """MLflow would put its artifacts in ./mlruns of whatever folder the run started in."""
    from raysim.tracking.mlflow_writer import MlflowWriter, TrackingError

    uri = postgres.database("no_root")
    with pytest.raises(TrackingError) as refused:
        MlflowWriter(uri, "elsewhere")
    assert str(refused.value) == (
        f"tracking.uri postgresql://***@127.0.0.1:{postgres.port}/no_root: a new experiment 'elsewhere' on a "
        "database store needs tracking.artifact_root, the folder or URI (s3://...) its artifacts go to (MLflow's "
        "default is ./mlruns of the working folder)"
    )
    assert MlflowClient(uri).get_experiment_by_name("elsewhere") is None


def test_raysim_ui_serves_the_runs_and_artifacts_of_the_postgresql_store(postgres, quickstart, tmp_path):
    """`raysim ui --tracking-uri postgresql://...`: the link opens the quickstart's experiment, the UI's API lists
    its run and serves its artifacts from the artifact root; the password is printed nowhere."""
    uri = quickstart[0]
    client, run = _finished(quickstart)
    experiment = run.info.experiment_id
    port = free_port()
    process = subprocess.Popen(
        [*RAYSIM, "ui", "--tracking-uri", uri, "--port", str(port)],
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        serving, link = process.stdout.readline().strip(), process.stdout.readline().strip()
        assert serving.startswith(f"MLflow UI on http://127.0.0.1:{port} (backend {redact(uri)}; log "), (
            serving,
            process.stderr.read() if process.poll() is not None else "",
        )
        assert link == f"open http://127.0.0.1:{port}/#/experiments/{experiment}/runs?workflowType=machine_learning"
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [experiment]}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            (listed,) = json.loads(response.read())["runs"]
        assert listed["info"]["run_id"] == run.info.run_id and listed["info"]["status"] == "FINISHED"
        query = urllib.parse.urlencode({"path": "config.yaml", "run_uuid": run.info.run_id})
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/get-artifact?{query}", timeout=60) as artifact:
            assert yaml.safe_load(artifact.read())["rounds"] == ROUNDS
        assert not _command_lines_holding(postgres.password)  # the URI reached MLflow's server in its environment
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        out, err = process.communicate(timeout=60)
    assert process.returncode == 143
    assert postgres.password not in serving + link + out + err


def test_a_suite_stopped_midway_resumes_on_postgresql_without_duplicates(postgres, tmp_path):
    """SIGTERM during the second child, then `raysim run SUITE --resume PARENT`: the finished child is kept as it
    was, the stopped one continues in its own MLflow run with every round logged once, the third runs."""
    uri = postgres.database("suite")
    path = resumable_suite(tmp_path, uri)
    suite = yaml.safe_load(path.read_text())
    suite["base"]["runtime"] = IN_PROCESS  # what is resumed is the store's runs, not Ray's actors
    suite["base"]["tracking"]["artifact_root"] = str(tmp_path / "artifacts")
    path.write_text(yaml.safe_dump(suite))
    parent = stop_during_the_second_child(path, uri, tmp_path)
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("resume").experiment_id

    def children() -> dict:
        found = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
        return {run.info.run_name: run for run in found}

    before = children()
    assert sorted(before) == ["first", "long"] and before["long"].info.status == "KILLED"
    assert client.get_run(parent).info.status == "KILLED"
    first_history = client.get_metric_history(before["first"].info.run_id, "pm/acc")

    done = _raysim("run", str(path), "--quiet", "--resume", parent, cwd=tmp_path)
    assert done.returncode == 0, done.stderr

    after = children()
    assert sorted(after) == ["first", "last", "long"]
    assert all(run.info.status == "FINISHED" for run in after.values())
    assert client.get_run(parent).info.status == "FINISHED"
    assert after["first"].info.run_id == before["first"].info.run_id
    assert client.get_metric_history(after["first"].info.run_id, "pm/acc") == first_history  # not logged again
    assert after["long"].info.run_id == before["long"].info.run_id
    assert _steps(client, after["long"].info.run_id, "pm/acc") == list(range(26))  # every round once
    assert _steps(client, after["last"].info.run_id, "pm/acc") == list(range(4))
    kept = tmp_path / "artifacts" / "resume" / parent / "artifacts"
    assert {"table_final.md", "summary.parquet"} <= {p.name for p in kept.iterdir()}
    assert not (tmp_path / "mlruns").exists()
