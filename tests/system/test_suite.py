"""Suites: config expansion and errors (plain Python), and every algorithm end to end through `raysim run`
on a suite file, logged to MLflow as child runs of one parent run."""

from __future__ import annotations

import contextlib
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from tests.support.experiments import tiny_config
from tests.support.logged import check_points, points
from tests.support.stores import fresh_store

RAYSIM = str(Path(sys.executable).parent / "raysim")


KILLED_ROUNDS = 20
"""Rounds of the children whose actor is killed: the test kills it once the child has logged round 1."""


@pytest.mark.slow
def test_failing_children_are_marked_failed_and_the_suite_goes_on_then_resumes_only_them(tmp_path, ray_local):
    """Children that fail in different ways while the others finish (issue 51.4): one whose uploads diverge in its
    hosts (algorithm.lr=1e30 with runtime.on_nonfinite=stop, the default: valid, but the run stops at its first
    round), one whose host process and one whose coordinator process is SIGKILLed mid-run (runtime.max_restarts=0:
    nothing replaces them). The children that lose no actor but the last run their hosts in process. Each is marked
    FAILED with its error; the children after them run on the same Ray (the last one on new actors); the
    suite (a real `raysim run` process) ends with the failed children named on stderr, nothing else there, and exit
    1, and its parent's summary, plot and tables come from the finished children. `--resume PARENT` then reruns
    only them: the killed ones continue from their checkpoints in the same MLflow runs, the one fixed in the suite
    file starts anew; every child's points are logged once each, the parent's too, and none logged before is lost."""
    uri = fresh_store(tmp_path / "mlflow.db")
    base = tiny_config(
        rounds=1,
        clients={"count": 3},
        runtime={"num_hosts": 1},  # new actors per child: the processes killed are the running child's (one host:
        # one process less importing torch per crew; a host's death is the subject, not how many there are)
        tracking={
            "uri": uri,
            "experiment": "failing",
            "checkpoint_every": 1,
            "checkpoint_dir": str(tmp_path / "ck"),
        },
    )
    # runtime.reuse_actors: the crew that lost an actor is never kept, but the second resumed child takes the first's
    killed = {"rounds": KILLED_ROUNDS, "runtime.max_restarts": 0, "runtime.reuse_actors": True}
    in_process = {"runtime.actors": "in_process"}  # no actor of theirs is killed: their starts would only cost time
    runs = [
        {"name": "before", "set": in_process},
        {"name": "diverges", "set": {**in_process, "algorithm.lr": 1e30}},
        {"name": "host-killed", "set": killed},
        {"name": "coordinator-killed", "set": {**killed, "seed": 8}},
        {"name": "after", "set": {"algorithm.rho": 0.5}},
    ]
    failing = ["diverges", "host-killed", "coordinator-killed"]
    path = tmp_path / "suite.yaml"
    path.write_text(yaml.safe_dump({"name": "one-bad", "base": base, "runs": runs}))

    client = MlflowClient(uri)
    client.search_experiments()  # the store exists: MLflow's own "creating tables" lines are not the suite's
    done = _run_killing_actors(
        path, client, {"host-killed": b"ray::ClientHost", "coordinator-killed": b"ray::Coordinator"}
    )
    assert done.returncode == 1, done.stderr
    printed = [line.split() for line in done.stdout.splitlines()]
    assert all([name, "failed"] in printed for name in failing), done.stdout
    assert len(next(row for row in printed if row[:1] == ["before"])) == 4

    experiment = client.get_experiment_by_name("failing").experiment_id
    (parent,) = client.search_runs([experiment], "tags.suite = 'one-bad'")
    parent_id = parent.info.run_id
    nested = f"tags.mlflow.parentRunId = '{parent_id}'"
    children = {r.info.run_name: r for r in client.search_runs([experiment], nested)}
    statuses = {name: "FAILED" if name in failing else "FINISHED" for name in [run["name"] for run in runs]}
    assert {n: r.info.status for n, r in children.items()} == statuses
    error = children["diverges"].data.tags["raysim.error"]
    assert "round 0: client" in error and "raysim.error" not in children["after"].data.tags
    for name, actor in (("host-killed", "host"), ("coordinator-killed", "coordinator")):
        lost = children[name].data.tags["raysim.error"]
        assert re.search(rf"\b{actor}\b.*died and cannot be replaced: runtime.max_restarts=0", lost), lost
    assert len(client.get_metric_history(children["after"].info.run_id, "pm/acc")) == 2  # rounds 0 and 1
    lines = [line for line in done.stderr.splitlines() if "file_system_monitor" not in line]  # Ray: a full disk
    assert lines[0] == "3 of 5 suite children failed (marked FAILED, error in their raysim.error tag):", done.stderr
    assert lines[1].startswith(f"  diverges: run {children['diverges'].info.run_id} stopped: ") and error in lines[1]
    for line, name in zip(lines[2:4], failing[1:], strict=True):
        assert line.startswith(f"  {name}: ") and children[name].data.tags["raysim.error"] in line, line
    rerun = f"`raysim run {path} --resume {parent_id}`"
    assert lines[4:] == [f"rerun the failed ones (finished ones are kept) with {rerun}"], done.stderr
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["raysim.error"] == f"3 of 5 children failed: {', '.join(failing)}"
    assert parent.data.metrics["children/failed"] == 3 and parent.data.metrics["children/finished"] == 2
    summary = pq.read_table(client.download_artifacts(parent_id, "summary.parquet", str(tmp_path))).to_pylist()
    assert [(row["run"], row["status"]) for row in summary] == [
        (name, "failed" if name in failing else "finished") for name in statuses
    ]
    assert summary[1]["error"] and math.isnan(summary[1]["final/pm/acc"]) and summary[4]["final/pm/acc"] > 0
    artifacts = {a.path for a in client.list_artifacts(parent_id)}
    assert {"comparison.png", "fairness.png", "table_final.md", "table_best.csv"} <= artifacts
    assert {"fairness.pdf", "fairness.svg"} <= artifacts
    table = Path(client.download_artifacts(parent_id, "table_final.md", str(tmp_path))).read_text()
    assert "left out, not finished: diverges (FAILED)" in table.splitlines()[0]
    assert [line.split(" | ")[0] for line in table.splitlines()[4:]] == ["| before", "| after"]
    logged_before = points(uri)

    runs[1]["set"] = {**in_process, "algorithm.lr": 0.05}  # the fix
    path.write_text(yaml.safe_dump({"name": "one-bad", "base": base, "runs": runs}))
    kept = {name: client.get_metric_history(children[name].info.run_id, "pm/acc") for name in ("before", "after")}
    assert main(["run", str(path), "--quiet", "--resume", parent_id]) == 0

    after = {r.info.run_name: r for r in client.search_runs([experiment], nested)}
    assert sorted(after) == sorted(statuses)
    assert all(r.info.status == "FINISHED" and "raysim.error" not in r.data.tags for r in after.values())
    for name, history in kept.items():  # kept, not run again
        assert after[name].info.run_id == children[name].info.run_id
        assert client.get_metric_history(after[name].info.run_id, "pm/acc") == history
    assert after["diverges"].info.run_id != children["diverges"].info.run_id  # its setting changed: run anew
    assert client.get_run(children["diverges"].info.run_id).info.lifecycle_stage == "deleted"
    logged = points(uri)
    for run in runs:
        name = run["name"]
        config = {**base, "rounds": KILLED_ROUNDS if name.endswith("killed") else 1}
        check_points(logged[after[name].info.run_id], config)  # every point once
        if name.endswith("killed"):  # continued in its run from its checkpoint: what it had logged is kept
            assert after[name].info.run_id == children[name].info.run_id
            for key, history in logged_before[children[name].info.run_id].items():
                assert logged[after[name].info.run_id][key][: len(history)] == history, (name, key)
    for key, history in logged[parent_id].items():  # the parent's summary: each metric once
        steps = [step for step, _ in history]
        assert len(steps) == len(set(steps)), f"parent's {key} logged more than once at a step: {history}"
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and "raysim.error" not in parent.data.tags
    assert parent.data.metrics["children/failed"] == 0
    (tmp_path / "again").mkdir()
    table = Path(client.download_artifacts(parent_id, "table_final.md", str(tmp_path / "again"))).read_text()
    assert "left out" not in table and "| diverges |" in table


def _run_killing_actors(path: Path, client: MlflowClient, victims: dict[str, bytes]) -> subprocess.CompletedProcess:
    """`raysim run SUITE --quiet` to its end; while child NAME of `victims` runs (once it has logged round 1),
    every process of the suite whose command line starts with victims[NAME] (a Ray actor's process title) is
    SIGKILLed."""
    from raysim.studies.procmem import descendants

    with open(path.parent / "stdout", "w+") as out, open(path.parent / "stderr", "w+") as err:
        suite = subprocess.Popen([RAYSIM, "run", str(path), "--quiet"], stdout=out, stderr=err)
        try:
            left = dict(victims)
            deadline = time.monotonic() + 600
            while suite.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
                for name, title in list(left.items()):
                    child = _running_child(client, name)
                    if child is None or len(client.get_metric_history(child, "pm/acc")) < 2:
                        continue
                    for pid in descendants(suite.pid):
                        with contextlib.suppress(OSError):
                            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(title):
                                os.kill(pid, signal.SIGKILL)
                                left.pop(name, None)
            suite.wait(timeout=max(1.0, deadline - time.monotonic()))
        finally:
            if suite.poll() is None:
                suite.kill()
        out.seek(0)
        err.seek(0)
        done = subprocess.CompletedProcess(suite.args, suite.returncode, out.read(), err.read())
    assert not left, f"the suite ran {sorted(left)} without its actor being killed: {done.stderr[-2000:]}"
    return done


def _running_child(client: MlflowClient, name: str) -> str | None:
    """The run id of the suite's child `name` while it is RUNNING."""
    experiment = client.get_experiment_by_name("failing")
    if experiment is None:
        return None
    running = client.search_runs(
        [experiment.experiment_id], f"attributes.run_name = '{name}' and attributes.status = 'RUNNING'"
    )
    return running[0].info.run_id if running else None
