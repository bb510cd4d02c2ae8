"""Three failures that printed a traceback of 130-150 lines (issue 51, section 2), each through a real `raysim run`: a
plugin that imports in the driver but not in Ray's workers, and a local Ray that cannot start, are one `error:` line
(exit 2, no traceback, no run); two runs started together on a new sqlite store both finish (MLflow creates a
store's tables with no lock of its own: raysim.tracking.mlflow_writer.store_lock)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml
from mlflow.tracking import MlflowClient

from tests.support.cli import RAYSIM
from tests.support.experiments import tiny_config
from tests.support.stores import fresh_store

DRIVER_ONLY = '''"""Imports in the driver; in a Ray worker it fails as a module that only the driver has would."""
import ray._private.worker as worker

if worker.global_worker.mode == worker.WORKER_MODE:
    raise ImportError("No module named 'lab_secrets'")
'''


def run(folder: Path, config: dict, env: dict[str, str] | None = None) -> subprocess.Popen:
    """A real `raysim run` of `config` in `folder`, started (not waited for)."""
    path = folder / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.Popen(
        [*RAYSIM, "run", str(path), "--quiet"],
        cwd=folder,
        env={**base, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def one_error_line(process: subprocess.Popen) -> str:
    """The process's one `error:` line, after checking it exited 2 with no traceback."""
    stdout, stderr = process.communicate(timeout=300)
    errors = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert process.returncode == 2 and len(errors) == 1, stderr[-3000:]
    assert "Traceback" not in stderr + stdout, stderr[-3000:]
    return errors[0]


def runs(uri: str) -> list:
    client = MlflowClient(uri)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


def test_a_plugin_that_fails_in_rays_workers_is_one_line_naming_it_before_the_run_starts(tmp_path, ray_local):
    """The plugin imports in the driver and raises in every Ray worker: each actor's creation failed, and Ray's
    tracebacks (the workers' and the driver's) ran to 137 lines. Now the plugins are imported in a worker on each
    node before the MLflow run is made: one line naming the plugin, its exception and the node; no run. The run
    joins the session's Ray (runtime.address) rather than starting one: the workers are the subject, not their
    Ray's start."""
    plugin = tmp_path / "driver_only.py"
    plugin.write_text(DRIVER_ONLY)
    uri = fresh_store(tmp_path / "mlflow.db")
    runtime = {"num_hosts": 1, "address": ray_local.get_runtime_context().gcs_address}
    config = tiny_config(rounds=1, runtime=runtime, tracking={"experiment": "tests", "uri": uri})
    config["plugins"] = [plugin.name]
    line = one_error_line(run(tmp_path, config))
    assert line.startswith(
        f"error: plugin {plugin}: ImportError: No module named 'lab_secrets' (in a Ray worker on node "
    )
    assert line.endswith("; it imports in the driver)"), line
    assert runs(uri) == []


def test_a_local_ray_that_cannot_start_is_one_line_naming_ray_and_its_logs(tmp_path):
    """Ray's temp folder too deep for its Unix sockets (a long $TMPDIR, as cluster schedulers set; here
    $RAY_TMPDIR): ray.init raised OSError with its traceback. Now one line: what Ray said, the way out, and the
    session folder of Ray's logs (named after this process, so never another run's)."""
    deep = tmp_path / ("d" * 60)
    deep.mkdir()
    uri = fresh_store(tmp_path / "mlflow.db")
    process = run(
        tmp_path, tiny_config(rounds=1, tracking={"experiment": "tests", "uri": uri}), {"RAY_TMPDIR": str(deep)}
    )
    line = one_error_line(process)
    said = "error: the local Ray did not start: OSError: validate_socket_filename failed: AF_UNIX path length"
    assert line.startswith(said) and " (set RAY_TMPDIR to a shorter folder); Ray's logs: " in line, line
    logs = Path(line.rsplit("; Ray's logs: ", 1)[1])
    assert logs.parent.parent == deep / "ray" and logs.parent.name.endswith(f"_{process.pid}"), line
    assert logs.name == "logs" and logs.is_dir(), line
    assert runs(uri) == []


def test_two_runs_started_together_on_a_new_sqlite_store_both_finish(tmp_path):
    """Two `raysim run` started together on a store that does not exist yet: the second crashed in MLflow's table
    creation ("table spans already exists", 151 lines) or found no experiment and made it twice. Now the store is
    opened under a lock on its folder: both finish, and the store holds both runs in one experiment."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    config = tiny_config(rounds=1, runtime={"actors": "in_process"}, tracking={"experiment": "tests", "uri": uri})
    folders = [tmp_path / "a", tmp_path / "b"]
    started = []
    for folder in folders:
        folder.mkdir()
        started.append(run(folder, config))
    for process in started:
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0 and "Traceback" not in stderr, stderr[-3000:]
        assert stdout.startswith("run "), stdout
    found = runs(uri)
    assert len(found) == 2 and {run.info.status for run in found} == {"FINISHED"}
    assert len({run.info.experiment_id for run in found}) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["a", "b", "mlartifacts", "mlflow.db"]
