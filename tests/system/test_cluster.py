"""A real multi-node Ray cluster on 127.0.0.1, each node its own `ray start`.

The cluster guide's recipe runs as written (read from docs/cluster.md at test time) with only its
ports, temp folder and $HOME replaced. A head and two worker nodes (LocalCluster: token authentication with a
fresh random token, a dedicated temp dir and ports) check placement, bit-for-bit results, a submitted sweep,
token errors, two runs at once and, last (each takes a worker node away, which LocalCluster.restore starts again
for the next), a sweep and a run that lose a worker node's raylet.
Clusters are stopped with raysim.jobs.stop_nodes (what the recipe uses), checked against an independent census
of their processes (a marker in their environment), never touching other Ray instances on the machine. Drivers
that connect to a cluster run as subprocesses (a probe, or Ray Jobs), so this test process never joins one.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.jobs import stop_nodes
from raysim.studies.procmem import descendants
from tests.support.cluster import free_port, kill_all, processes_with
from tests.support.experiments import tiny_config
from tests.support.logged import check_points, points
from tests.support.paths import ROOT
from tests.support.stores import fresh_store
from tests.support.sweeps import children_of, metric_steps, parent_of

pytestmark = pytest.mark.xdist_group("system-cluster")
"""One worker runs this module's tests: its three-node cluster is started once."""

RECIPE_MARKER = "<!-- test: cluster-recipe"
RECIPE_PORTS = {"6379": "GCS", "8265": "dashboard", "5000": "MLflow"}
NODE_PORT_FLAGS = (
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)


def readme_recipe() -> str:
    """The ```bash block after the cluster-recipe marker in the cluster guide (docs/cluster.md), as written."""
    text = (ROOT / "docs" / "cluster.md").read_text()
    after = text[text.index(RECIPE_MARKER) :]
    return after.split("```bash\n", 1)[1].split("\n```", 1)[0]


def localize(recipe: str, temp_dir: str) -> tuple[str, dict[str, int]]:
    """The recipe with its ports (GCS, dashboard, MLflow) moved to free ports and its --temp-dir to `temp_dir`;
    each `ray start` also gets its own agent ports (and the head its client-server port), which nodes sharing
    one machine need and separate machines do not. Nothing else changes."""
    script = recipe.replace("\\\n", " ")
    ports = {old: free_port() for old in RECIPE_PORTS}
    for old, new in ports.items():
        assert re.search(rf"(?<![0-9]){old}(?![0-9])", script), f"recipe lost its {RECIPE_PORTS[old]} port"
        script = re.sub(rf"(?<![0-9]){old}(?![0-9])", str(new), script)
    temp_dirs = set(re.findall(r"--temp-dir[ =](\S+)", script))
    assert len(temp_dirs) == 1, f"cluster-guide recipe: one --temp-dir for all nodes expected, got {temp_dirs}"
    script = script.replace(temp_dirs.pop(), temp_dir)
    lines = []
    for line in script.splitlines():
        if re.match(r"\s*ray start ", line):
            extra = [f"{flag} {free_port()}" for flag in NODE_PORT_FLAGS]
            if "--head" in line:
                extra.append(f"--ray-client-server-port {free_port()}")
            line = line.replace("ray start ", f"ray start {' '.join(extra)} ", 1)
        lines.append(line)
    return "\n".join(lines) + "\n", {RECIPE_PORTS[old]: new for old, new in ports.items()}


@pytest.mark.slow
def test_readme_cluster_recipe_runs_as_written(ray_local, tmp_path):
    """The cluster-guide recipe, from `ray start` to stopping: its job's run lands in its MLflow server with metrics,
    imports raysim only from the shipped working dir, and stopping leaves none of its processes and every
    other Ray process (this session's local Ray) running."""
    from mlflow.tracking import MlflowClient

    bystanders = [
        info.process.pid for infos in ray_local._private.worker._global_node.all_processes.values() for info in infos
    ]
    temp_dir = tempfile.mkdtemp(prefix="rsr-", dir="/tmp")  # short: Ray's socket paths live under it
    home = tmp_path / "home"
    home.mkdir()
    script, ports = localize(readme_recipe(), temp_dir)
    (tmp_path / "recipe.sh").write_text(script)
    marker = f"RAYSIM_RECIPE_TEST={secrets.token_hex(8)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env |= {
        "HOME": str(home),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES": str(256 * 2**20),  # two nodes on one shared machine
        marker.split("=")[0]: marker.split("=")[1],
    }
    try:
        # Output to files, not pipes: a recipe that fails half-way leaves its MLflow server holding them open.
        with open(tmp_path / "out.txt", "w") as stdout, open(tmp_path / "err.txt", "w") as stderr:
            recipe = ["bash", "-ex", str(tmp_path / "recipe.sh")]
            code = subprocess.run(recipe, cwd=ROOT, env=env, stdout=stdout, stderr=stderr, timeout=600).returncode
        out, err = (tmp_path / "out.txt").read_text(), (tmp_path / "err.txt").read_text()
        assert code == 0, f"{out}\n{err[-5000:]}"
        assert "Ray runtime started" in err + out
        assert re.search(r"job \S+: SUCCEEDED", out), out
        run_id = re.search(r"mlflow run ([0-9a-f]{32}) at http://127.0.0.1:" + str(ports["MLflow"]), out).group(1)
        roots = re.search(r"raysim code: (.*)", out).group(1)
        assert roots.startswith(str(Path(temp_dir).resolve())) and "," not in roots, roots  # the shipped copy only
        assert re.search(r"stopped \d+ Ray processes", out), out

        left = kill_all(lambda: processes_with(marker, temp_dir), wait_s=30)
        assert not left, f"the recipe left processes {left}"
        for pid in bystanders:
            os.kill(pid, 0)  # raises if another Ray instance's process was stopped
        assert ray_local.cluster_resources().get("CPU")

        client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")  # the stopped server's store
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED" and run.data.tags.get("raysim.hosts") == "2"
        history = client.get_metric_history(run_id, "pm/acc")
        assert [m.step for m in history] == [0, 1, 2] and all(0.0 <= m.value <= 1.0 for m in history)
        assert (home / "mlartifacts").is_dir()
    finally:
        with contextlib.suppress(Exception):
            stop_nodes(temp_dir)
        kill_all(lambda: processes_with(marker, temp_dir), wait_s=0)
        shutil.rmtree(temp_dir, ignore_errors=True)


def placement_config(placement: str, uri: str) -> dict:
    return tiny_config(
        clients={"count": 6, "per_round": 4},
        rounds=3,
        runtime={
            "num_hosts": 2,
            "host_cpus": 0.5,
            "placement": placement,
            "host_resources": {"host_slot": 1},
            "coordinator_resources": {"coordinator": 1},
        },
        tracking={"uri": uri, "experiment": "placement"},
    )


def probe(configs_path: str, out_path: str) -> None:
    """Driver run in a subprocess connected to the cluster: runs each config, records where actors ran."""
    import ray

    from raysim.runtime.driver import run_experiment

    ray.init()  # RAY_ADDRESS: the cluster; run_experiment then reuses this connection
    outcome = {}
    for name, data in json.loads(Path(configs_path).read_text()).items():
        captured: dict = {}

        def inspect(round_index, simulation, captured=captured):
            where = [a.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id()) for a in simulation.hosts]
            captured["hosts"] = ray.get(where)
            captured["coordinator"] = ray.get(
                simulation.coordinator.__ray_call__.remote(lambda _: ray.get_runtime_context().get_node_id())
            )
            captured["states"] = simulation.client_states()
            captured["w"] = simulation.server_state().w

        run_experiment(validate_config(data), show_progress=False, inspect=inspect)
        outcome[name] = captured
    outcome["nodes"] = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    Path(out_path).write_bytes(pickle.dumps(outcome))


@pytest.mark.slow
def test_hosts_land_on_intended_nodes_and_match_single_process_run(cluster, tmp_path):
    uri = fresh_store(tmp_path / "mlflow.db")
    configs = {p: placement_config(p, uri) for p in ("spread", "pack")}
    (tmp_path / "configs.json").write_text(json.dumps(configs))
    subprocess.run(
        [sys.executable, "-m", "tests.system.test_cluster", str(tmp_path / "configs.json"), str(tmp_path / "out.pkl")],
        cwd=ROOT,
        env=cluster.driver_env(),
        check=True,
        timeout=600,
    )
    outcome = pickle.loads((tmp_path / "out.pkl").read_bytes())
    nodes = outcome["nodes"]
    assert len(nodes) == 3
    for placement in ("spread", "pack"):
        run = outcome[placement]
        assert all(nodes[n].get("host_slot") for n in run["hosts"]), placement
        assert nodes[run["coordinator"]].get("coordinator") == 1.0, placement
    assert len(set(outcome["spread"]["hosts"])) == 2  # one host on each worker node
    assert len(set(outcome["pack"]["hosts"])) == 1  # both hosts on one worker node

    from tests.support.inprocess import InProcess

    reference = InProcess(validate_config(configs["spread"]))
    for round_index in range(3):
        reference.round(round_index)
    for placement in ("spread", "pack"):
        np.testing.assert_array_equal(outcome[placement]["w"], reference.server.w)
        for client_id, state in reference.states.items():
            ran = outcome[placement]["states"][client_id]
            for name in ("theta", "w", "pi"):
                np.testing.assert_array_equal(getattr(ran, name), getattr(state, name))


def _rest(server: str, endpoint: str, **query) -> dict:
    with urllib.request.urlopen(f"{server}/api/2.0/mlflow/{endpoint}?{urllib.parse.urlencode(query)}") as response:
        return json.load(response)


@pytest.mark.slow
def test_a_submitted_sweep_of_plugin_files_runs_on_every_node_and_logs_to_the_tracking_server(
    cluster, tmp_path, capsys
):
    """`raysim submit` of a sweep whose algorithm, model and dataset are plugin files kept outside the package (two
    listed in the sweep file, one given with --plugin): the files go with the job, the hosts, which only the worker
    nodes can hold, import them there, and the trials log to an MLflow server: the parent, its children with their
    curves, and the parent's comparison artifacts; `raysim jobs`, `logs` and `cancel` know the job. One trial (a
    grid of one value of the plugin algorithm's own setting), its two hosts spread over both worker nodes: a second
    trial started four more Ray workers, each importing raysim and the plugins, and checked nothing more."""
    from raysim.cli import main
    from raysim.tracking.server import ServerSettings, TrackingServer
    from tests.support.pages import page_files

    mine = tmp_path / "mine"
    mine.mkdir()
    for name, text in page_files().items():
        (mine / name).write_text(text)
    subprocess.run([sys.executable, "make_csv.py"], cwd=mine, check=True)
    base = tiny_config(
        algorithm={"name": "my_fedavgm", "lr": 0.05, "batch_size": 32},
        model={"name": "tiny_cnn"},
        dataset={"name": "csv", "path": str(mine / "digits.csv"), "shape": [1, 8, 8]},
        rounds=2,
        runtime={"num_hosts": 2, "host_cpus": 0.5, "placement": "spread", "host_resources": {"host_slot": 1}},
        tracking={"experiment": "cluster-sweep"},
    )
    sweep = {
        "name": "cluster-sweep",
        "plugins": ["mine/fedavgm.py", "mine/tiny_cnn.py"],
        "base": base,
        "grid": {"algorithm.server_momentum": [0.5]},
        "seeds": [1],
    }
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(sweep))
    settings = ServerSettings(
        f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts"), "127.0.0.1", free_port()
    )
    with TrackingServer(settings, tmp_path / "server.log"):
        args = ["--address", cluster.dashboard, "--auth-token", cluster.token]
        plugin = ["--plugin", str(mine / "csv_source.py")]
        code = main(["submit", str(path), *plugin, "--tracking-uri", settings.url, "--follow", *args])
        out = capsys.readouterr().out
        assert code == 0, out[-3000:]
        job_id = out.split("job ", 1)[1].split()[0]
        parent = out.split("mlflow run ", 1)[1].split()[0]
        assert len(parent) == 32
        assert "sweep cluster-sweep: parent run" in out
        roots = re.search(r"raysim code: (.*)", out).group(1)  # the job's shipped copy, not this checkout
        assert roots.startswith(str(cluster.root.resolve())) and "," not in roots, roots

        assert main(["jobs", *args]) == 0
        listing = capsys.readouterr().out
        assert listing.splitlines()[0].split()[:4] == ["job", "status", "started", "mlflow"]
        (row,) = [line for line in listing.splitlines() if line.startswith(job_id)]
        assert "SUCCEEDED" in row and parent in row
        assert main(["logs", job_id, *args]) == 0
        assert "sweep cluster-sweep: parent run" in capsys.readouterr().out
        assert main(["cancel", job_id, *args]) == 0
        assert "already finished" in capsys.readouterr().out

        experiment = _rest(settings.url, "experiments/get-by-name", experiment_name="cluster-sweep")
        experiment_id = experiment["experiment"]["experiment_id"]
        request = urllib.request.Request(
            f"{settings.url}/api/2.0/mlflow/runs/search",
            data=json.dumps({"experiment_ids": [experiment_id], "max_results": 100}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request) as response:
            runs = json.load(response)["runs"]
        children = [r for r in runs if {"key": "mlflow.parentRunId", "value": parent} in r["data"].get("tags", [])]
        assert len(children) == 1
        assert all(r["info"]["status"] == "FINISHED" for r in children)
        for child in children:
            history = _rest(settings.url, "metrics/get-history", run_id=child["info"]["run_id"], metric_key="pm/acc")
            assert [m["step"] for m in history["metrics"]] == [0, 1, 2]
            assert all(0.0 <= m["value"] <= 1.0 for m in history["metrics"])
            run = MlflowClient(settings.url).get_run(child["info"]["run_id"])
            assert run.data.params["plugins"] == "['fedavgm', 'tiny_cnn', 'csv_source']"
            assert run.data.params["algorithm.server_momentum"] == "0.5"
            assert (run.data.tags["algorithm"], run.data.params["model.name"], run.data.tags["dataset"]) == (
                "my_fedavgm",
                "tiny_cnn",
                "csv",
            )
        files = {f["path"] for f in _rest(settings.url, "artifacts/list", run_id=parent).get("files", [])}
        assert {"summary.parquet", "accuracy_vs_round.png", "final_accuracy.png"} <= files


@pytest.mark.slow
def test_missing_or_wrong_token_is_one_error_line(cluster, tmp_path, monkeypatch, capsys):
    from raysim.cli import main

    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_MODE", "RAY_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token of this machine's user
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "no-token"))
    (tmp_path / "exp.yaml").write_text(json.dumps(tiny_config()))
    commands = [["jobs"], ["cancel", "raysubmit_none"], ["logs", "raysubmit_none"]]
    commands.append(["submit", str(tmp_path / "exp.yaml")])
    for token in (["--auth-token", "wrong"], []):
        for command in commands:
            assert main([*command, "--address", cluster.dashboard, *token]) == 2, command
            captured = capsys.readouterr()
            assert captured.out == "" and captured.err.count("\n") == 1, captured.err
            assert captured.err.startswith(f"error: --address {cluster.dashboard}: the Ray cluster refused ")
            assert all(place in captured.err for place in ("--auth-token", "$RAY_AUTH_TOKEN", "~/.ray/auth_token"))
            assert ("the token from --auth-token" if token else "no $RAY_AUTH_TOKEN") in captured.err
    monkeypatch.setenv("RAY_AUTH_TOKEN", cluster.token)
    assert main(["jobs", "--address", cluster.dashboard]) == 0


LOAD_ROUNDS = 8


def load_config(uri: str, seed: int, checkpoints: Path) -> dict:
    """A job of the tests under load: two hosts spread over the worker nodes (a host slot and half a CPU each: two
    such jobs fill them), the coordinator anywhere, a checkpoint every round."""
    return tiny_config(
        clients={"count": 6, "per_round": 4},
        rounds=LOAD_ROUNDS,
        seed=seed,
        runtime={"num_hosts": 2, "host_cpus": 0.5, "placement": "spread", "host_resources": {"host_slot": 1}},
        tracking={"uri": uri, "experiment": "load", "checkpoint_every": 1, "checkpoint_dir": str(checkpoints)},
    )


def start_job(cluster, config: dict, folder: Path) -> subprocess.Popen:
    """`raysim run` of `config` as a driver (a Ray job) of the cluster, its stderr into folder/stderr."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "run.yaml").write_text(json.dumps(config))
    with open(folder / "stderr", "w") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "raysim.cli", "run", str(folder / "run.yaml"), "--quiet"],
            cwd=folder,
            env=cluster.driver_env(),
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def only_run(uri: str) -> str:
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("load").experiment_id])
    return run.info.run_id


@pytest.fixture(scope="module")
def two_jobs(cluster, tmp_path_factory) -> dict[int, tuple[dict, str]]:
    """Two `raysim run` of different seeds started together on the cluster, logging to one sqlite store: seed ->
    (config, run id)."""
    folder = tmp_path_factory.mktemp("two-jobs")
    uri = fresh_store(folder / "mlflow.db")
    configs = {seed: load_config(uri, seed, folder / f"ck{seed}") for seed in (7, 8)}
    jobs = {seed: start_job(cluster, config, folder / str(seed)) for seed, config in configs.items()}
    for seed, job in jobs.items():
        assert job.wait(timeout=300) == 0, (folder / str(seed) / "stderr").read_text()[-3000:]
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("load").experiment_id])
    by_seed = {int(r.data.params["seed"]): r.info.run_id for r in runs}
    assert len(runs) == 2 and sorted(by_seed) == [7, 8]
    return {seed: (configs[seed], by_seed[seed]) for seed in configs}


@pytest.mark.slow
def test_two_jobs_at_once_on_one_cluster_and_store_log_only_their_own_points(two_jobs):
    """Two runs at once on the cluster and one MLflow store (issue 51.4): both finish, each with every point once
    and nothing of the other (a point of the other would be a second one at its step)."""
    (config, _), _ = two_jobs.values()
    logged = points(config["tracking"]["uri"])
    assert set(logged) == {run_id for _, run_id in two_jobs.values()}
    for config, run_id in two_jobs.values():
        check_points(logged[run_id], config)
    seven, eight = (logged[two_jobs[seed][1]]["pm/loss"] for seed in (7, 8))
    assert seven != eight  # two different runs, not one logged twice
    client = MlflowClient(config["tracking"]["uri"])
    first, second = sorted((client.get_run(run_id).info for _, run_id in two_jobs.values()), key=lambda i: i.start_time)
    assert second.start_time < first.end_time, "the two runs did not overlap: nothing ran at once"


def _node_loss_sweep(folder: Path, uri: str) -> Path:
    """Three trials on the cluster's two worker nodes (one host on each: spread), checkpointed every round, one
    trial at a time."""
    base = tiny_config(
        clients={"count": 6, "per_round": 4},
        rounds=6,
        runtime={
            "num_hosts": 2,
            "host_cpus": 0.5,
            "placement": "spread",
            "host_resources": {"host_slot": 1},
            "coordinator_resources": {"coordinator": 1},
        },
        tracking={
            "uri": uri,
            "experiment": "sweep_node_loss",
            "checkpoint_every": 1,
            "checkpoint_dir": str(folder / "checkpoints"),
        },
    )
    sweep = {"name": "lost", "base": base, "grid": {"algorithm.lr": [0.05, 0.1, 0.2]}, "max_concurrent": 1}
    path = folder / "sweep.yaml"
    path.write_text(json.dumps(sweep))
    return path


@pytest.mark.slow
def test_a_sweep_on_a_cluster_loses_no_trial_when_a_worker_node_dies(cluster, tmp_path):
    """`raysim sweep` as a driver of a head and two worker nodes; once its first trial has finished and the second
    has logged a round, worker_b's raylet and every process under it are SIGKILLed (the node is gone for good). The
    trials' drivers run on the head (their Tune actors reserve its marker resource) and the running trial's lost
    host is recreated on worker_a from its last checkpoint: every trial ends FINISHED, each once in MLflow, with
    every round once and no metric point twice."""
    raylet = cluster.restore().raylet("worker_b")  # the whole cluster, whichever of these tests ran before
    assert raylet is not None
    uri = fresh_store(tmp_path / "mlflow.db")
    path = _node_loss_sweep(tmp_path, uri)
    client = MlflowClient(uri)
    command = [sys.executable, "-m", "raysim.cli", "sweep", str(path), "--quiet"]
    with open(tmp_path / "out", "w") as out, open(tmp_path / "err", "w") as err:
        process = subprocess.Popen(command, cwd=ROOT, env=cluster.driver_env(), stdout=out, stderr=err)
        try:
            killed_during = None
            deadline = time.monotonic() + 400
            while killed_during is None and process.poll() is None and time.monotonic() < deadline:
                time.sleep(0.5)  # a round takes seconds; each look is two queries of the sqlite store
                experiment = client.get_experiment_by_name("sweep_node_loss")
                if experiment is None:
                    continue
                runs = client.search_runs([experiment.experiment_id], "tags.mlflow.parentRunId != ''")
                done = [r for r in runs if r.info.status == "FINISHED"]
                running = [r for r in runs if r.info.status == "RUNNING" and "time/round" in r.data.metrics]
                if done and running:
                    for pid in descendants(raylet):
                        os.kill(pid, signal.SIGKILL)
                    killed_during = running[0].info.run_name
            assert killed_during is not None, (tmp_path / "err").read_text()[-3000:]
            assert process.wait(400) == 0, (tmp_path / "err").read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
    parent = parent_of((tmp_path / "out").read_text())
    children = children_of(client, parent)
    names = [run.info.run_name for run in children]
    assert sorted(names) == [f"lost/t00{i} lr={lr} seed=7" for i, lr in enumerate((0.05, 0.1, 0.2))]
    assert all(run.info.status == "FINISHED" for run in children), [(r.info.run_name, r.info.status) for r in children]
    for run in children:
        for key, steps in metric_steps(client, run).items():
            assert not [s for s, n in Counter(steps).items() if n > 1], (run.info.run_name, key, steps)
        assert metric_steps(client, run)["time/round"] == [1, 2, 3, 4, 5, 6]
    assert killed_during in names
    assert client.get_run(parent).info.status == "FINISHED"
    assert not Path(f"/proc/{raylet}").exists()  # worker_b is gone for good


def cmdline(pid: int) -> bytes:
    """A process's command line as /proc has it (empty once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


@pytest.mark.slow
def test_a_run_whose_worker_node_raylet_is_killed_finishes_as_an_uninterrupted_one(cluster, two_jobs, tmp_path):
    """The last test of the module: it takes a node away. `raysim run` on the cluster, and the raylet of a worker
    node holding one of its hosts SIGKILLed with every process under it once round 2 is checkpointed: the host is
    made again on the other worker node from the checkpoint, and the run finishes with every point once and the
    points of the same run uninterrupted (two_jobs' seed 7) (issue 8, issue 51.4)."""
    assert len(cluster.restore().nodes()) == 3  # worker_b again, after the sweep's test took it away
    baseline, baseline_id = two_jobs[7]
    uri = fresh_store(tmp_path / "mlflow.db")
    config = load_config(uri, 7, tmp_path / "ck")
    raylet = cluster.raylet("worker_b")
    assert raylet is not None
    job = start_job(cluster, config, tmp_path / "job")
    try:
        while max((int(m.parent.name[6:]) for m in (tmp_path / "ck").glob("*/round-*/manifest.json")), default=0) < 2:
            assert job.poll() is None, (tmp_path / "job" / "stderr").read_text()[-3000:]
            time.sleep(0.05)
        node = descendants(raylet)
        hosts = [pid for pid in node if cmdline(pid).startswith(b"ray::ClientHost")]
        assert hosts, "no host of the run on the node: killing it tests nothing"
        for pid in node:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert job.poll() is None, "the run ended before its node was lost: the test tested nothing"
        assert job.wait(timeout=300) == 0, (tmp_path / "job" / "stderr").read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    run_id = only_run(uri)
    logged = points(uri)[run_id]
    check_points(logged, config)
    expected = points(baseline["tracking"]["uri"])[baseline_id]
    for key, history in expected.items():
        if not key.startswith(("time/", "system/")):
            assert logged[key] == history, key


if __name__ == "__main__":
    probe(sys.argv[1], sys.argv[2])
