"""Suites: config expansion and errors (plain Python), and every algorithm end to end through `raysim run`
on a suite file, logged to MLflow as child runs of one parent run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from tests.support.experiments import tiny_config
from tests.support.stores import fresh_store

RAYSIM = str(Path(sys.executable).parent / "raysim")


@pytest.mark.slow
def test_a_failing_child_is_marked_failed_and_the_suite_goes_on_then_resumes_only_it(tmp_path, ray_local):
    """A child whose uploads diverge (algorithm.lr=1e30 with runtime.on_nonfinite=stop, the default: valid, but
    the run stops at its first round) is marked FAILED with its error; the children after it run on the same Ray;
    the suite (a real `raysim run` process) ends with the failed child named on stderr, nothing else there, and
    exit 1, and its parent's summary, plot and tables come from the finished children. Fixed in the suite file,
    `--resume PARENT` reruns that child only."""
    uri = fresh_store(tmp_path / "mlflow.db")
    base = tiny_config(rounds=1, clients={"count": 3}, tracking={"uri": uri, "experiment": "failing"})
    runs = [
        {"name": "before", "set": {}},
        {"name": "diverges", "set": {"algorithm.lr": 1e30}},
        {"name": "after", "set": {"algorithm.rho": 0.5}},
    ]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "one-bad", "base": base, "runs": runs}))

    client = MlflowClient(uri)
    client.search_experiments()  # the store exists: MLflow's own "creating tables" lines are not the suite's
    done = subprocess.run([RAYSIM, "run", str(path), "--quiet"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr
    printed = [line.split() for line in done.stdout.splitlines()]
    assert ["diverges", "failed"] in printed and len(next(row for row in printed if row[:1] == ["before"])) == 4

    experiment = client.get_experiment_by_name("failing").experiment_id
    (parent,) = client.search_runs([experiment], "tags.suite = 'one-bad'")
    parent_id = parent.info.run_id
    nested = f"tags.mlflow.parentRunId = '{parent_id}'"
    children = {r.info.run_name: r for r in client.search_runs([experiment], nested)}
    assert {n: r.info.status for n, r in children.items()} == {
        "before": "FINISHED",
        "diverges": "FAILED",
        "after": "FINISHED",
    }
    error = children["diverges"].data.tags["raysim.error"]
    assert "round 0: client" in error and "raysim.error" not in children["after"].data.tags
    assert len(client.get_metric_history(children["after"].info.run_id, "pm/acc")) == 2  # rounds 0 and 1
    lines = done.stderr.splitlines()
    assert lines[0] == "1 of 3 suite children failed (marked FAILED, error in their raysim.error tag):", done.stderr
    assert lines[1].startswith(f"  diverges: run {children['diverges'].info.run_id} stopped: ") and error in lines[1]
    rerun = f"`raysim run {path} --resume {parent_id}`"
    assert lines[2:] == [f"rerun the failed ones (finished ones are kept) with {rerun}"], done.stderr
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["raysim.error"] == "1 of 3 children failed: diverges"
    assert parent.data.metrics["children/failed"] == 1 and parent.data.metrics["children/finished"] == 2
    summary = pq.read_table(client.download_artifacts(parent_id, "summary.parquet", str(tmp_path))).to_pylist()
    assert [(row["run"], row["status"]) for row in summary] == [
        ("before", "finished"),
        ("diverges", "failed"),
        ("after", "finished"),
    ]
    assert summary[1]["error"] and math.isnan(summary[1]["final/pm/acc"]) and summary[2]["final/pm/acc"] > 0
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"comparison.png", "fairness.png", "table_final.md", "table_best.csv"} <= artifacts
    assert {"fairness.pdf", "fairness.svg"} <= artifacts
    table = Path(client.download_artifacts(parent_id, "table_final.md", str(tmp_path))).read_text()
    assert "left out, not finished: diverges (FAILED)" in table.splitlines()[0]
    assert [line.split(" | ")[0] for line in table.splitlines()[4:]] == ["| before", "| after"]

    runs[1]["set"] = {"algorithm.lr": 0.05}  # the fix
    path.write_text(yaml.safe_dump({"name": "one-bad", "base": base, "runs": runs}))
    kept = {name: client.get_metric_history(children[name].info.run_id, "pm/acc") for name in ("before", "after")}
    assert main(["run", str(path), "--quiet", "--resume", parent_id]) == 0

    after = {r.info.run_name: r for r in client.search_runs([experiment], nested)}
    assert sorted(after) == ["after", "before", "diverges"]
    assert all(r.info.status == "FINISHED" and "raysim.error" not in r.data.tags for r in after.values())
    for name, history in kept.items():  # kept, not run again
        assert after[name].info.run_id == children[name].info.run_id
        assert client.get_metric_history(after[name].info.run_id, "pm/acc") == history
    assert after["diverges"].info.run_id != children["diverges"].info.run_id  # its setting changed: run anew
    assert client.get_run(children["diverges"].info.run_id).info.lifecycle_stage == "deleted"
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and "raysim.error" not in parent.data.tags
    assert parent.data.metrics["children/failed"] == 0
    (tmp_path / "again").mkdir()
    table = Path(client.download_artifacts(parent_id, "table_final.md", str(tmp_path / "again"))).read_text()
    assert "left out" not in table and "| diverges |" in table
