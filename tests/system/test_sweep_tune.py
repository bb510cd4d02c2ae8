"""Sweeps as Ray Tune trials (issue 50.4): the shipped ASHA sweep, small, run through the CLI, its stopped trial
recorded and kept by a resume. The sweep on a local three-node cluster that loses a worker node mid-sweep is in
tests/system/test_cluster.py, on that module's cluster."""

from __future__ import annotations

import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.studies.sweep import load_sweep
from tests.support.paths import ROOT
from tests.support.stores import fresh_store
from tests.support.sweeps import children_of, metric_steps, parent_of

SHIPPED = ROOT / "configs" / "sweep_asha.yaml"


@pytest.mark.slow
def test_the_shipped_asha_sweep_stops_its_worst_trial_and_a_resume_keeps_it(tmp_path, fmnist_tenth, ray_local, capsys):
    """configs/sweep_asha.yaml validates with ASHA; its small version (its grid and scheduler, one seed, 4 rounds of
    the quickstart on a tenth of Fashion-MNIST, one host in the trial's own process: the scheduler is the subject
    here, not the actors) runs through `raysim sweep`, as a user runs it, in a process of its own.
    ASHA's rungs are rounds 2 and 4 (grace_period 2, reduction_factor 2, max_t = rounds): the trial at lr=0.001,
    last in the grid, reaches round 2 after the three others and is stopped there, its run FINISHED with the
    rounds it ran and the `raysim.stopped_early` tag; a trial that reaches the rung at its last round is not cut
    short (its last round is reported once its run has finished). `raysim sweep --resume` (the CLI's `main`, in
    this process: it runs no trial) keeps every trial and logs no point twice."""
    shipped = load_sweep(SHIPPED)
    assert (shipped.scheduler.name, shipped.scheduler.grace_period, shipped.scheduler.reduction_factor) == (
        "asha",
        2,
        2.0,
    )
    assert len(shipped.trials("sqlite:////tmp/x.db")) == 8

    data = yaml.safe_load(SHIPPED.read_text())
    base = yaml.safe_load((SHIPPED.parent / data.pop("base_config")).read_text())
    base |= {"rounds": 4, "clients": {"count": 4}, "runtime": {"actors": "in_process", "num_hosts": 1}}
    base["dataset"] = {**base["dataset"], "root": str(fmnist_tenth)}
    uri = fresh_store(tmp_path / "mlflow.db")
    base["tracking"] = {"uri": uri, "experiment": "asha", "figures": []}
    small = tmp_path / "sweep_asha.yaml"
    small.write_text(yaml.safe_dump({**data, "base": base, "seeds": [1], "max_concurrent": 1}))

    command = [sys.executable, "-m", "raysim.cli", "sweep", str(small)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    parent = parent_of(out)
    lines = [line for line in out.splitlines() if line.startswith("trial ")]
    assert len(lines) == 4
    assert lines[3].startswith("trial   3 lr=0.001 seed=1: stopped early by asha at round 2 of 4, last PM "), out
    assert all(": finished, final PM " in line for line in lines[:3]), out

    client = MlflowClient(uri)
    children = {run.info.run_name: run for run in children_of(client, parent)}
    assert len(children) == 4 and {run.info.status for run in children.values()} == {"FINISHED"}
    stopped = {name for name, run in children.items() if "raysim.stopped_early" in run.data.tags}
    assert stopped == {"flame-lr-asha/t003 lr=0.001 seed=1"}
    stopped_run = children[stopped.pop()]
    assert stopped_run.data.tags["raysim.stopped_early"] == "asha at round 2 of 4"
    assert "raysim.error" not in stopped_run.data.tags  # not the exit of its experiment's worker
    rounds = {name: metric_steps(client, run)["time/round"] for name, run in children.items()}
    assert all(steps == [1, 2, 3, 4] for name, steps in rounds.items() if "lr=0.001" not in name)
    assert rounds["flame-lr-asha/t003 lr=0.001 seed=1"][:2] == [1, 2]
    assert len(rounds["flame-lr-asha/t003 lr=0.001 seed=1"]) < 4
    before = {name: metric_steps(client, run) for name, run in children.items()}
    summary = pq.read_table(client.download_artifacts(parent, "summary.parquet", str(tmp_path))).to_pylist()
    assert [row["status"] for row in summary] == ["finished", "finished", "finished", "stopped"]
    metrics = client.get_run(parent).data.metrics
    assert (metrics["children/finished"], metrics["children/stopped"], metrics["children/failed"]) == (3, 1, 0)

    capsys.readouterr()
    assert main(["sweep", str(small), "--quiet", "--resume", parent]) == 0
    assert parent_of(capsys.readouterr().out) == parent
    after = {run.info.run_name: run for run in children_of(client, parent)}
    assert {name: run.info.run_id for name, run in after.items()} == {
        name: run.info.run_id for name, run in children.items()
    }
    assert {name: metric_steps(client, run) for name, run in after.items()} == before
    assert client.get_run(parent).info.status == "FINISHED"
