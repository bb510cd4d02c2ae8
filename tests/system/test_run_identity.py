"""What the MLflow UI shows about a run before its metrics: the experiment opens as model training, the run has a
name that says what ran, MLflow's standard tags, a description, and its dataset as an input with the partition's
digest; options left unset are not logged as "None". Checked on the shipped quickstart, run as a user runs it."""

from __future__ import annotations

import shutil

import pytest
from mlflow.tracking import MlflowClient

from tests.support.cli import raysim
from tests.support.paths import ROOT


@pytest.mark.slow
def test_a_quickstart_run_fills_mlflows_standard_fields(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")  # MLflow's knob: samples in a short run
    config = tmp_path / "quickstart.yaml"
    shutil.copy(ROOT / "configs" / "quickstart.yaml", config)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    done = raysim("run", str(config), "--quiet", "--set", "rounds=1", "--set", f"tracking.uri={uri}", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    # a healthy run's console has no Ray warnings or errors (token-auth default, actor-restart caveat)
    assert "WARNING" not in done.stderr and "ERROR" not in done.stderr and "core_worker" not in done.stderr, done.stderr
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("quickstart")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (run,) = client.search_runs([experiment.experiment_id])
    tags, params = run.data.tags, run.data.params
    assert run.info.run_name == "flame-fmnist-q2-s1"
    assert tags["mlflow.source.name"] == f"raysim run {config} --quiet --set rounds=1 --set tracking.uri={uri}"
    assert tags["mlflow.source.type"] == "JOB" and tags["mlflow.user"]  # JOB: the runs table shows it whole
    assert len(tags["mlflow.source.git.commit"]) == 40
    assert tags["mlflow.note.content"].startswith("flame on fashion_mnist, partition q_label, 10 clients, 1 rounds")
    assert "malicious_clients" not in tags and "git_commit" not in tags  # no attack: no empty tag
    assert "None" not in params.values() and "tracking.run_name" not in params
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == "fashion_mnist/q2" and len(dataset_input.dataset.digest) == 16
    assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", "training")]
