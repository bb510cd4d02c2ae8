"""`raysim` as a user runs it: a subprocess in a folder of the test's, and a run whose MLflow run is read back."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

RAYSIM = [sys.executable, "-m", "raysim.cli"]

HOSTS_IN_PROCESS = ("--set", "runtime.actors=in_process")
"""For a `raysim run` whose subject is not Ray (the command line, what reaches MLflow, a method's metrics): the hosts
and the coordinator run in the driver's process (runtime.actors: in_process), which computes what Ray hosts compute
(tests/integration/test_matrix_on_ray.py) without starting a Ray and three processes that import torch."""


def write_config(tmp_path: Path, config: dict) -> Path:
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def raysim(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.run([*RAYSIM, *args], capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def run_cli(tmp_path: Path, config: dict, *options: str) -> Run:
    """`raysim run` on the config (written to tmp_path), which must succeed; the one MLflow run it made in the
    config's tracking store and experiment."""
    done = raysim("run", str(write_config(tmp_path, config)), *options, "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    tracking = config["tracking"]
    client = MlflowClient(tracking["uri"])
    (run,) = client.search_runs([client.get_experiment_by_name(tracking["experiment"]).experiment_id])
    return run
