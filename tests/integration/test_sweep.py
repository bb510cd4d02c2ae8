"""Sweeps: settings from grid and random draws, validation, and a real concurrent sweep on local Ray."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from raysim.studies.sweep import parse_sweep, run_sweep
from tests.support.experiments import IN_PROCESS, tiny_config


@pytest.mark.slow
def test_concurrent_sweep_records_a_failed_trial_and_finishes_the_others(ray_local, mlflow_uri, tmp_path, capsys):
    """model.name=cnn on vector data fails inside its trial (after validation); the mlr trials still run. The
    parent run is named first, then each trial's end. The trials are Ray Tune trials, two at a time on the session's
    Ray; their hosts run in the trial's process (the subject is the sweep, not actors: each trial's three actor
    starts took most of this test's time)."""
    base = tiny_config(
        rounds=2,
        runtime={**IN_PROCESS, "host_cpus": 0.5},
        tracking={"uri": mlflow_uri, "experiment": "sweep"},
    )
    sweep = parse_sweep({"name": "mixed", "base": base, "grid": {"model.name": ["mlr", "cnn"]}, "seeds": [1, 2]})
    command = "raysim run mixed.yaml --set rounds=2"
    result = run_sweep(sweep, show_progress=True, command=command)
    assert result.failed == [2, 3]
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith(f"sweep mixed: parent run {result.parent_run_id} at ") and "4 trials" in printed[0]
    compare = f"raysim ui --tracking-uri {mlflow_uri} --compare {result.parent_run_id}"
    assert printed[1] == f"  compare its trials in MLflow: {compare}"
    assert sum(line.startswith("trial ") for line in printed) == 4
    client = MlflowClient(mlflow_uri)
    parent = client.get_run(result.parent_run_id)
    assert parent.info.status == "FINISHED"
    assert parent.data.metrics["children/failed"] == 2 and parent.data.metrics["children/finished"] == 2
    failed_names = "mixed/t002 name=cnn seed=1, mixed/t003 name=cnn seed=2"
    assert parent.data.tags["raysim.error"] == f"2 of 4 children failed: {failed_names}"
    children = client.search_runs(
        [parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{result.parent_run_id}'"
    )
    status = sorted((r.info.run_name, r.info.status) for r in children)
    assert {r.data.tags.get("raysim.group") for r in children if r.info.status == "FINISHED"} == {"name=mlr"}
    assert {r.data.tags["mlflow.source.name"] for r in [parent, *children]} == {command}  # not the Ray worker's
    finals = [
        max(client.get_metric_history(r.info.run_id, "pm/acc"), key=lambda m: m.step).value
        for r in children
        if r.info.status == "FINISHED"
    ]
    assert parent.data.metrics["name_mlr/pm/acc"] == pytest.approx(sum(finals) / 2)  # mean over its 2 seeds
    assert not any(key.startswith("name_cnn/") for key in parent.data.metrics)  # both failed
    assert [s for _, s in status] == ["FINISHED", "FINISHED", "FAILED", "FAILED"]
    failed = [r for r in children if r.info.status == "FAILED"]
    assert all("model.name=cnn needs image input" in r.data.tags["raysim.error"] for r in failed)
    assert [result.outcomes[i].error for i in (2, 3)] == [
        r.data.tags["raysim.error"] for r in sorted(failed, key=lambda r: r.info.run_name)
    ]
    finished = [r for r in children if r.info.status == "FINISHED"]
    assert all(len(client.get_metric_history(r.info.run_id, "pm/acc")) == 3 for r in finished)
    folder = client.download_artifacts(result.parent_run_id, "", str(tmp_path))
    table = pq.read_table(f"{folder}/summary.parquet").to_pylist()
    assert [row["status"] for row in table] == ["finished", "finished", "failed", "failed"]
    assert [row["run_id"] for row in table] == [result.outcomes[i].run_id for i in range(4)]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"accuracy_vs_round.png", "final_accuracy.png"} <= artifacts
