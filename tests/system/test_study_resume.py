"""A stopped suite resumes: `raysim run SUITE.yaml --resume PARENT_RUN` keeps finished children, continues the
interrupted one from its checkpoint in the same MLflow run, starts the missing ones, and never duplicates one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.cli import main
from raysim.config import validate_config
from raysim.runtime.driver import run_experiment
from tests.support.experiments import IN_PROCESS, tiny_config
from tests.support.paths import ROOT
from tests.support.stores import fresh_store
from tests.support.studies import resumable_suite, stop_during_the_second_child
from tests.support.terminal import sigint_as_from_a_terminal

REPO = ROOT


def _runs(client: MlflowClient, parent: str) -> dict[str, object]:
    experiment = client.get_experiment_by_name("resume").experiment_id
    return {r.info.run_name: r for r in client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")}


@pytest.mark.slow
def test_a_stopped_suite_resumes_without_duplicates_and_ends_as_an_uninterrupted_one(tmp_path, ray_local):
    uri = fresh_store(tmp_path / "mlflow.db")
    path = resumable_suite(tmp_path, uri)
    parent = stop_during_the_second_child(path, uri, tmp_path)
    client = MlflowClient(uri)
    before = _runs(client, parent)
    assert sorted(before) == ["first", "long"] and before["long"].info.status == "KILLED"
    assert before["long"].data.tags["raysim.error"].startswith("interrupted by SIGTERM after round ")
    stopped = client.get_run(parent)
    assert stopped.info.status == "KILLED"  # not FAILED: nothing went wrong with it
    assert stopped.data.tags["raysim.error"] == "interrupted by SIGTERM in its child 'long' (1 of 3 done)"
    assert (tmp_path / "stderr").read_text().splitlines()[-1] == (
        f"suite stopped interrupted by SIGTERM in its child 'long' (1 of 3 done): parent run {parent} marked KILLED; "
        f"continue with `raysim run {path} --resume {parent}`"
    )
    first_history = client.get_metric_history(before["first"].info.run_id, "pm/acc")

    assert main(["run", str(path), "--quiet", "--resume", parent]) == 0

    after = _runs(client, parent)
    assert sorted(after) == ["first", "last", "long"]
    assert all(r.info.status == "FINISHED" for r in after.values()) and client.get_run(parent).info.status == "FINISHED"
    assert not any("raysim.error" in r.data.tags for r in (*after.values(), client.get_run(parent)))  # none stale
    assert after["first"].info.run_id == before["first"].info.run_id  # kept, not logged again
    assert client.get_metric_history(after["first"].info.run_id, "pm/acc") == first_history
    assert after["long"].info.run_id == before["long"].info.run_id  # continued in the same MLflow run
    steps = [m.step for m in client.get_metric_history(after["long"].info.run_id, "pm/acc")]
    assert sorted(steps) == list(range(26))  # every round once

    tree = yaml.safe_load(path.read_text())["base"] | {"rounds": 25, "seed": 3}
    tree["tracking"] = {"uri": f"sqlite:///{tmp_path / 'fresh.db'}", "experiment": "fresh"}
    fresh = run_experiment(validate_config(tree), show_progress=False)
    for key in ("pm/acc", "gm/acc", "pm/loss"):
        assert after["long"].data.metrics[key] == fresh.summary[f"final/{key}"]
    artifacts = {a.path for a in client.list_artifacts(parent)}
    assert {"table_final.md", "table_best.csv", "comparison.png", "summary.parquet"} <= artifacts


@pytest.mark.slow
def test_a_stopped_sweep_resumes_keeping_its_finished_trials(tmp_path, ray_local):
    """Ctrl-C (SIGINT) stops the sweep: the trial in flight and the parent are marked KILLED, and the one line
    names the command that continues it. The trials' hosts run in their Tune trial's process: the subject is the
    sweep's stop and resume, not actors."""
    uri = fresh_store(tmp_path / "mlflow.db")
    base = tiny_config(rounds=3, runtime=IN_PROCESS, tracking={"uri": uri, "experiment": "resume"})
    sweep = {"name": "swept", "base": base, "grid": {"algorithm.lr": [0.05, 0.1, 0.2]}, "max_concurrent": 1}
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    client = MlflowClient(uri)
    client.search_experiments()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with open(tmp_path / "stderr", "w") as err:
        process = subprocess.Popen(
            [sys.executable, "-m", "raysim.cli", "sweep", str(path), "--quiet"],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=sigint_as_from_a_terminal,
        )
        try:
            deadline, parent = time.monotonic() + 300, None
            while time.monotonic() < deadline and parent is None:
                time.sleep(0.2)
                experiment = client.get_experiment_by_name("resume")
                if experiment is None:
                    continue
                runs = client.search_runs([experiment.experiment_id])
                if any(r.info.status == "FINISHED" for r in runs if "mlflow.parentRunId" in r.data.tags):
                    parent = next(r.info.run_id for r in runs if r.data.tags.get("sweep") == "swept")
            assert parent is not None, (tmp_path / "stderr").read_text()
            process.send_signal(signal.SIGINT)
            assert process.wait(120) == 130, (tmp_path / "stderr").read_text()
        finally:
            if process.poll() is None:
                process.kill()
    experiment = client.get_experiment_by_name("resume").experiment_id
    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    kept = {r.info.run_name: r.info.run_id for r in children if r.info.status == "FINISHED"}
    assert 1 <= len(kept) < 3
    stopped = [r for r in children if r.info.status != "FINISHED"]
    assert all(r.info.status == "KILLED" and "interrupted" in r.data.tags["raysim.error"] for r in stopped), [
        (r.info.run_name, r.info.status, r.data.tags.get("raysim.error")) for r in stopped
    ]
    assert client.get_run(parent).info.status == "KILLED"
    last = (tmp_path / "stderr").read_text().splitlines()[-1]
    assert last.startswith("sweep swept interrupted by SIGINT with ") and last.endswith(
        f": parent run {parent} marked KILLED; continue with `raysim run {path} --resume {parent}`"
    ), last

    assert main(["sweep", str(path), "--quiet", "--resume", parent]) == 0

    children = client.search_runs([experiment], f"tags.mlflow.parentRunId = '{parent}'")
    names = sorted(r.info.run_name for r in children)
    assert len(names) == 3 == len(set(names)) and all(r.info.status == "FINISHED" for r in children)
    assert "raysim.error" not in client.get_run(parent).data.tags
    assert {r.info.run_name: r.info.run_id for r in children if r.info.run_name in kept} == kept
    assert "table_final.md" in {a.path for a in client.list_artifacts(parent)}
