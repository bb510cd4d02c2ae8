"""Sweeps as Ray Tune trials (issue 50.4): the shipped ASHA sweep, small, run through the CLI, its stopped trial
recorded and kept by a resume; and a sweep on a local three-node cluster that loses a worker node mid-sweep."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.studies.procmem import descendants
from raysim.studies.sweep import load_sweep
from tests.support.experiments import tiny_config
from tests.support.paths import ROOT
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("system-cluster")
"""The node-loss test starts a three-node cluster; it runs beside the cluster tests' worker, not in parallel."""

SHIPPED = ROOT / "configs" / "sweep_asha.yaml"


def _sweep(path: Path, *options: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "raysim.cli", "sweep", str(path), *options]
    done = subprocess.run(command, cwd=path.parent, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def _children(client: MlflowClient, parent: str) -> list:
    experiment = client.get_run(parent).info.experiment_id
    return client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'", max_results=1000)


def _points(client: MlflowClient, run) -> dict[str, list[int]]:
    """Every metric's logged steps (a point logged twice shows as a repeated step)."""
    return {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}


def _parent_of(out: str) -> str:
    return out.split("parent run ", 1)[1].split()[0]


@pytest.mark.slow
def test_the_shipped_asha_sweep_stops_its_worst_trial_and_a_resume_keeps_it(tmp_path, fmnist_tenth, ray_local, capsys):
    """configs/sweep_asha.yaml validates with ASHA; its small version (its grid and scheduler, one seed, 4 rounds
    of the quickstart on a tenth of Fashion-MNIST, one host) runs through `raysim sweep`. ASHA's rungs are rounds 2
    and 4 (grace_period 2, reduction_factor 2, max_t = rounds): the trial at lr=0.001, last in the grid, reaches
    round 2 after the three others and is stopped there, its run FINISHED with the rounds it ran and the
    `raysim.stopped_early` tag; a trial that reaches the rung at its last round is not cut short (its last round
    is reported once its run has finished). `raysim sweep --resume` (the CLI's `main`, in this process: it runs no
    trial) keeps every trial and logs no point twice."""
    shipped = load_sweep(SHIPPED)
    assert (shipped.scheduler.name, shipped.scheduler.grace_period, shipped.scheduler.reduction_factor) == (
        "asha",
        2,
        2.0,
    )
    assert len(shipped.trials("sqlite:////tmp/x.db")) == 8

    data = yaml.safe_load(SHIPPED.read_text())
    base = yaml.safe_load((SHIPPED.parent / data.pop("base_config")).read_text())
    base |= {"rounds": 4, "clients": {"count": 4}, "runtime": {"num_hosts": 1}}
    base["dataset"] = {**base["dataset"], "root": str(fmnist_tenth)}
    uri = fresh_store(tmp_path / "mlflow.db")
    base["tracking"] = {"uri": uri, "experiment": "asha", "figures": []}
    small = tmp_path / "sweep_asha.yaml"
    small.write_text(yaml.safe_dump({**data, "base": base, "seeds": [1], "max_concurrent": 1}))

    out = _sweep(small).stdout
    parent = _parent_of(out)
    lines = [line for line in out.splitlines() if line.startswith("trial ")]
    assert len(lines) == 4
    assert lines[3].startswith("trial   3 lr=0.001 seed=1: stopped early by asha at round 2 of 4, last PM "), out
    assert all(": finished, final PM " in line for line in lines[:3]), out

    client = MlflowClient(uri)
    children = {run.info.run_name: run for run in _children(client, parent)}
    assert len(children) == 4 and {run.info.status for run in children.values()} == {"FINISHED"}
    stopped = {name for name, run in children.items() if "raysim.stopped_early" in run.data.tags}
    assert stopped == {"flame-lr-asha/t003 lr=0.001 seed=1"}
    stopped_run = children[stopped.pop()]
    assert stopped_run.data.tags["raysim.stopped_early"] == "asha at round 2 of 4"
    assert "raysim.error" not in stopped_run.data.tags  # not the exit of its experiment's worker
    rounds = {name: _points(client, run)["time/round"] for name, run in children.items()}
    assert all(steps == [1, 2, 3, 4] for name, steps in rounds.items() if "lr=0.001" not in name)
    assert rounds["flame-lr-asha/t003 lr=0.001 seed=1"][:2] == [1, 2]
    assert len(rounds["flame-lr-asha/t003 lr=0.001 seed=1"]) < 4
    before = {name: _points(client, run) for name, run in children.items()}
    summary = pq.read_table(client.download_artifacts(parent, "summary.parquet", str(tmp_path))).to_pylist()
    assert [row["status"] for row in summary] == ["finished", "finished", "finished", "stopped"]
    metrics = client.get_run(parent).data.metrics
    assert (metrics["children/finished"], metrics["children/stopped"], metrics["children/failed"]) == (3, 1, 0)

    capsys.readouterr()
    assert main(["sweep", str(small), "--quiet", "--resume", parent]) == 0
    assert _parent_of(capsys.readouterr().out) == parent
    after = {run.info.run_name: run for run in _children(client, parent)}
    assert {name: run.info.run_id for name, run in after.items()} == {
        name: run.info.run_id for name, run in children.items()
    }
    assert {name: _points(client, run) for name, run in after.items()} == before
    assert client.get_run(parent).info.status == "FINISHED"


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
    path.write_text(yaml.safe_dump(sweep))
    return path


@pytest.mark.slow
def test_a_sweep_on_a_cluster_loses_no_trial_when_a_worker_node_dies(cluster, tmp_path):
    """`raysim sweep` as a driver of a head and two worker nodes; once its first trial has finished and the second
    has logged a round, worker_b's raylet and every process under it are SIGKILLed (the node is gone for good). The
    trials' drivers run on the head (their Tune actors reserve its marker resource) and the running trial's lost
    host is recreated on worker_a from its last checkpoint: every trial ends FINISHED, each once in MLflow, with
    every round once and no metric point twice."""
    raylets = [
        pid
        for pid in cluster.own_pids()
        if b"raylet" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
        and b"worker_b" in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    assert len(raylets) == 1, raylets
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
                time.sleep(0.2)
                experiment = client.get_experiment_by_name("sweep_node_loss")
                if experiment is None:
                    continue
                runs = client.search_runs([experiment.experiment_id], "tags.mlflow.parentRunId != ''")
                done = [r for r in runs if r.info.status == "FINISHED"]
                running = [r for r in runs if r.info.status == "RUNNING" and "time/round" in r.data.metrics]
                if done and running:
                    for pid in descendants(raylets[0]):
                        os.kill(pid, signal.SIGKILL)
                    killed_during = running[0].info.run_name
            assert killed_during is not None, (tmp_path / "err").read_text()[-3000:]
            assert process.wait(400) == 0, (tmp_path / "err").read_text()[-3000:]
        finally:
            if process.poll() is None:
                process.kill()
    parent = _parent_of((tmp_path / "out").read_text())
    children = _children(client, parent)
    names = [run.info.run_name for run in children]
    assert sorted(names) == [f"lost/t00{i} lr={lr} seed=7" for i, lr in enumerate((0.05, 0.1, 0.2))]
    assert all(run.info.status == "FINISHED" for run in children), [(r.info.run_name, r.info.status) for r in children]
    for run in children:
        for key, steps in _points(client, run).items():
            assert not [s for s, n in Counter(steps).items() if n > 1], (run.info.run_name, key, steps)
        assert _points(client, run)["time/round"] == [1, 2, 3, 4, 5, 6]
    assert killed_during in names
    assert client.get_run(parent).info.status == "FINISHED"
    assert not Path(f"/proc/{raylets[0]}").exists()  # worker_b is gone for good
