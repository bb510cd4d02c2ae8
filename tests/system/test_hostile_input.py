"""Hostile config input (not UTF-8, nested thousands deep, a bool or a non-finite float for a number, a `partition.q`
above the class count) is one `error:` line, exit 2, before any Ray or MLflow work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.hostile_input import CLI_CASES, check_refused, cli_case


def test_the_raysim_process_exits_2_with_one_line_and_no_traceback(tmp_path):
    """A real `python -m raysim.cli run` for a file that is not UTF-8 and a --set value nested 5,000 deep (both
    were tracebacks), run at once: what a person sees."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    started = {}
    for name in ("not-utf8", "deep-set"):
        folder = tmp_path / name
        folder.mkdir()
        command = [sys.executable, "-m", "raysim.cli", *cli_case(folder, name)]
        pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
        started[name] = (subprocess.Popen(command, cwd=folder, env=env, text=True, **pipes), folder)
    for name, (process, folder) in started.items():
        stdout, stderr = process.communicate(timeout=300)
        check_refused(process.returncode, stdout, stderr, folder, CLI_CASES[name][3])


@pytest.mark.slow
def test_experiment_and_run_names_reach_mlflow_as_typed(tmp_path):
    """A real `raysim run` with `--experiment "my exp #2"` and a run name YAML would have cut or retyped; and a
    comment in a number refused by a real process, before Ray."""
    from mlflow.tracking import MlflowClient

    from tests.support.experiments import tiny_config

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_config(rounds=1, tracking={"uri": uri})))
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    raysim = str(Path(sys.executable).parent / "raysim")
    refused = subprocess.run(
        [raysim, "run", str(path), "--quiet", "--set", "rounds=1 #x"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: --set rounds: '#x' would be a YAML comment and dropped from the value '1 #x'; quote the text that "
        "holds it, or leave the comment out"
    ], refused.stderr
    assert not (tmp_path / "mlflow.db").exists()
    done = subprocess.run(
        [raysim, "run", str(path), "--quiet", "--experiment", "my exp #2", "--set", "tracking.run_name=no #1: on"]
        + ["--set", "runtime.actors=in_process"],  # the names are the subject, not Ray
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("my exp #2").experiment_id])
    assert run.info.run_name == "no #1: on" and run.data.params["tracking.experiment"] == "my exp #2"
