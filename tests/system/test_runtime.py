"""The Ray runtime: invariants on live actor state, packing determinism, state of unselected clients."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.experiments import tiny_config
from tests.support.one_process import raysim_commands


@pytest.mark.slow
def test_gpu_shares_bound_the_host_count_on_a_real_ray(tmp_path, mlflow_uri):
    """A local Ray declaring one GPU (it need not exist: a host without CUDA trains on the CPU) takes two
    hosts at 0.5 GPU each, though its CPUs would hold four; declaring none refuses the run with the key. Both
    `raysim run`s in one process of their own (tests/support/one_process.py), the refused one first."""
    runtime = {"num_cpus": 2, "num_gpus": 1, "host_cpus": 0.5, "host_gpus": 0.5, "client_training": "vectorized"}
    tracking = {"uri": mlflow_uri, "experiment": "gpus"}
    configs = {
        "refused": tiny_config(runtime={**runtime, "num_gpus": 0}, tracking=tracking, rounds=2),
        "declared": tiny_config(runtime=runtime, tracking=tracking, rounds=2),
    }
    commands = {}
    for name, config in configs.items():
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        commands[name] = (["run", str(tmp_path / f"{name}.yaml"), "--quiet"], tmp_path)
    done = raysim_commands(commands)
    refused = done["refused"]
    assert refused["code"] != 0
    assert "runtime.host_gpus=0.5 (+ coordinator 0) needs 0.5 GPUs but the Ray cluster has 0" in refused["stderr"]
    assert done["declared"]["code"] == 0, done["declared"]["stderr"][-3000:]
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("gpus").experiment_id])
    assert run.info.status == "FINISHED" and run.data.tags["raysim.hosts"] == "2"


SIBLINGS_SCRIPT = """
import gc, sys, time, ray
from raysim.runtime.actors import get_all

@ray.remote(num_cpus=0)
class Host:
    def train(self, delay, name):
        time.sleep(delay)
        raise ValueError(name)

def start_round(name):
    hosts = [Host.remote(), Host.remote()]
    return hosts, [host.train.remote(delay, name) for host, delay in zip(hosts, [0.0, 2.0])]

ray.init(address=sys.argv[1])  # the session's Ray: a driver of its own, whose console is the subject
rounds = {name: start_round(name) for name in ("left-unretrieved", "retrieved")}  # side by side: one wait
for name, (hosts, refs) in rounds.items():
    try:
        get_all(refs) if name == "retrieved" else ray.get(refs)
    except ray.exceptions.RayTaskError:
        pass
time.sleep(3)  # the refs live on while the late siblings fail
del rounds, hosts, refs
gc.collect()
time.sleep(1)
ray.shutdown()
"""


@pytest.mark.slow
def test_a_failed_rounds_late_sibling_errors_are_got_so_ray_prints_no_unhandled_error(ray_local):
    """A call to the hosts (a round, an evaluation) whose first host failed waits for the others and gets their
    results (`get_all`): a sibling failing a little later was dropped unread, and Ray printed its traceback as an
    "Unhandled error" on a suite's console. The control (a plain `ray.get` of the list) shows the test sees such a
    line. The script is a driver of its own, joined to the session's Ray rather than starting one."""
    address = ray_local.get_runtime_context().gcs_address
    script = [sys.executable, "-c", SIBLINGS_SCRIPT, address]
    done = subprocess.run(script, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("Unhandled error") == 1 and "ValueError: left-unretrieved" in done.stderr, done.stderr
    assert "ValueError: retrieved" not in done.stderr, done.stderr


LEAN_SCRIPT = """
import sys, time
from pathlib import Path
import ray
from raysim.config import validate_config
from raysim.runtime import session
from raysim.studies.procmem import descendants

config = validate_config(
    {"algorithm": {"name": "fedavg"}, "model": {"name": "mlp"}, "clients": {"count": 8},
     "runtime": {"num_cpus": 4, "num_hosts": 1}}
)

def workers(raylet):
    titles = []
    for pid in descendants(raylet)[1:]:
        try:
            titles.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    agents = ("ray::RuntimeEnv", "ray::Dashboard")  # the raylet's agents, as /proc's comm cuts their names
    return [title for title in titles if title.startswith("ray::") and not title.startswith(agents)]

with session.ray_session(config):
    commands = [" ".join(map(str, p.args)) for p in session._local.started]
    (raylet,) = [p.pid for p in session._local.started if str(p.args[0]).endswith("raylet")]
    deadline = time.monotonic() + 60
    while len(workers(raylet)) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # any more would have started by now
    print("workers", len(workers(raylet)))

    @ray.remote(num_cpus=0)
    def preloaded():
        return [name for name in ("raysim.runtime.coordinator", "torch") if name in sys.modules]

    print("preloaded", ",".join(ray.get(preloaded.remote())))
print("monitor", sum(any(part.endswith(session.MONITOR) for part in c.split()) for c in commands))
print("dashboard", sum("dashboard/dashboard.py" in c for c in commands))
print("agent", ["minimal" if "--minimal" in c else "full" for c in commands if "dashboard/agent.py" in c])
"""


@pytest.mark.slow
def test_a_local_ray_starts_only_what_the_run_needs(tmp_path):
    """No autoscaler monitor (Ray's shutdown then spent a second of grace on it), no dashboard head (ray.init waited
    for it before starting the raylet), a minimal dashboard agent (the raylet waits for it), as many workers at
    first as the run's actors (one host and the coordinator on a 4-CPU Ray: 2, not Ray's 4), and its workers import
    the coordinator's module as they start, not torch (the coordinator does not need it)."""
    done = subprocess.run([sys.executable, "-c", LEAN_SCRIPT], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    assert lines["preloaded"] == "raysim.runtime.coordinator", done.stdout
    assert (lines["monitor"], lines["dashboard"], lines["workers"]) == ("0", "0", "2"), done.stdout
    assert lines["agent"] == "['minimal']", done.stdout  # the raylet's command, which starts it


EXIT_SCRIPT = """
import atexit, sys, threading, time

atexit.register(lambda: print("exit handler ran"))
threading.Thread(target=lambda: (time.sleep(0.5), print("thread finished"))).start()
from raysim.cli import main

sys.argv = ["raysim", "run", "absent.yaml"]
main()
print("main returned")
"""


def test_the_raysim_command_ends_without_teardown_yet_as_any_exit(tmp_path):
    """The `raysim` command ends the process when done without the interpreter's teardown (a second of CPU) yet as
    any exit: its threads joined, its exit handlers run, its exit code kept (2, a file that is not there)."""
    done = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stdout.splitlines() == ["thread finished", "exit handler ran"], done.stdout
    assert done.stderr.startswith("error: ") and "absent.yaml" in done.stderr, done.stderr
