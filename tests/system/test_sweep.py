"""Sweeps: settings from grid and random draws, validation, and a real concurrent sweep on local Ray."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.logged import check_points, points
from tests.support.stores import fresh_store
from tests.support.studies import sweep_data

RAYSIM = str(Path(sys.executable).parent / "raysim")


def test_raysim_run_takes_a_sweep_file_and_names_its_bad_key(tmp_path):
    """`raysim run` dispatches on the file: the error is the sweep's, not an experiment's missing sections."""
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps(sweep_data(grid={"algorithm.rho": []})))
    done = subprocess.run([RAYSIM, "run", str(path)], capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert done.stderr.strip() == f"error: {path}: grid.algorithm.rho: needs at least one value"


@pytest.mark.slow
def test_a_20_trial_sweep_logs_every_trial_and_every_point_once(tmp_path):
    """`raysim sweep` of 20 trials (10 settings x 2 seeds, 3 clients, 2 rounds each) to its end, its trials as many
    at once as its local Ray holds (issue 51.4): the parent and its 20 trials FINISHED in the store, each setting and
    seed once, no other run; each trial's metric points once per step with the documented keys, the parent's once."""
    uri = fresh_store(tmp_path / "mlflow.db")
    rates = [round(0.01 * (i + 1), 2) for i in range(10)]
    runtime = {**IN_PROCESS, "host_cpus": 0.5}  # a trial reserves one CPU: as many at once as the CPUs, not half
    base = tiny_config(rounds=2, clients={"count": 3}, runtime=runtime, tracking={"experiment": "load"})
    sweep = {"name": "twenty", "base": base, "grid": {"algorithm.lr": rates}, "seeds": [1, 2]}
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(sweep))
    done = subprocess.run(
        [RAYSIM, "sweep", str(tmp_path / "sweep.yaml"), "--tracking-uri", uri, "--quiet"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-3000:]

    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("load").experiment_id], max_results=100)
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "twenty"]
    trials = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(runs) == 21 and len(trials) == 20
    assert all(r.info.status == "FINISHED" for r in runs), [(r.info.run_name, r.info.status) for r in runs]
    settings = sorted((float(r.data.params["algorithm.lr"]), int(r.data.params["seed"])) for r in trials)
    assert settings == sorted((lr, seed) for lr in rates for seed in (1, 2))
    assert len({r.info.run_name for r in trials}) == 20

    logged = points(uri)
    assert set(logged) <= {r.info.run_id for r in runs}
    for trial in trials:
        check_points(logged[trial.info.run_id], base)
    for key, history in logged.get(parent.info.run_id, {}).items():
        steps = [step for step, _ in history]
        assert len(steps) == len(set(steps)), f"parent's {key} logged more than once at a step: {steps}"
