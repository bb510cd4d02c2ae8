"""Small suites and sweeps for the study tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.experiments import tiny_config
from tests.support.paths import ROOT


def sweep_data(**extra) -> dict:
    return {"name": "s", "base": tiny_config(), **extra}


def resumable_suite(folder: Path, uri: str) -> Path:
    base = tiny_config(
        rounds=3,
        tracking={
            "uri": uri,
            "experiment": "resume",
            "checkpoint_every": 1,
            "checkpoint_dir": str(folder / "checkpoints"),
        },
    )
    suite = {
        "name": "stopped",
        "base": base,
        "runs": [
            {"name": "first", "set": {}},
            {"name": "long", "set": {"rounds": 25, "seed": 3}},
            {"name": "last", "set": {"algorithm.lr": 0.1}},
        ],
    }
    path = folder / "suite.yaml"
    path.write_text(yaml.safe_dump(suite))
    return path


def stop_during_the_second_child(path: Path, uri: str, folder: Path) -> str:
    """Run `resumable_suite`'s suite (`raysim run`) in its own process and SIGTERM it once the first child finished
    and the second has logged a few rounds (checkpointed every round); returns the parent run id."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    client = MlflowClient(uri)
    client.search_experiments()  # the store's tables exist before two processes open it
    with open(folder / "stderr", "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "raysim.cli", "run", str(path), "--quiet"],
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                time.sleep(0.2)
                if client.get_experiment_by_name("resume") is None:
                    continue
                experiment = client.get_experiment_by_name("resume").experiment_id
                parents = [r for r in client.search_runs([experiment]) if r.data.tags.get("suite") == "stopped"]
                if not parents:
                    continue
                found = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parents[0].info.run_id}'")
                children = {run.info.run_name: run for run in found}
                long = children.get("long")
                if long is not None and len(client.get_metric_history(long.info.run_id, "pm/acc")) >= 4:
                    assert children["first"].info.status == "FINISHED"
                    process.send_signal(signal.SIGTERM)
                    assert process.wait(120) == 143, (folder / "stderr").read_text()
                    return parents[0].info.run_id
            pytest.fail(f"the suite never reached its second child: {(folder / 'stderr').read_text()}")
        finally:
            if process.poll() is None:
                process.kill()
    raise AssertionError("unreachable")
