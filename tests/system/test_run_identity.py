"""What the MLflow UI shows about a run before its metrics: the experiment opens as model training, the run has a
name that says what ran, MLflow's standard tags, a description, and its dataset as an input with the partition's
digest; options left unset are not logged as "None". Checked on the shipped quickstart, run as a user runs it."""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
from mlflow.tracking import MlflowClient

from tests.support.checkpoints import marker_plugin
from tests.support.cli import raysim
from tests.support.paths import ROOT


@pytest.mark.slow
def test_a_quickstart_run_fills_mlflows_standard_fields(tmp_path, monkeypatch):
    """The same run, given a tracking password in the environment and a plugin that records, in every process that
    imports it (the driver, and each host and the coordinator, which import the run's plugins before they unpickle
    anything of it), its pid and whether it holds the password, shows that the password stays in the driver, out of
    every process of the local Ray (issue 51, section 3: what
    test_the_tracking_password_stays_out_of_the_local_rays_processes checked in a run of its own)."""
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "1")  # MLflow's knob: samples in a short run
    secret = f"secret-{uuid.uuid4().hex}"
    seen = tmp_path / "seen.txt"
    body = (
        f"held = os.environ.get('MLFLOW_TRACKING_PASSWORD') == {secret!r}\n"
        f"with open({str(seen)!r}, 'a') as f:\n"
        "    f.write(str(os.getpid()) + ' ' + str(held) + chr(10))\n"
    )
    plugin, _ = marker_plugin(tmp_path, "looks", body)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "user")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", secret)
    config = tmp_path / "quickstart.yaml"
    shutil.copy(ROOT / "configs" / "quickstart.yaml", config)
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    options = ["--quiet", "--set", "rounds=1", "--set", f"tracking.uri={uri}", "--plugin", str(plugin)]
    done = raysim("run", str(config), *options, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line.split() for line in seen.read_text().splitlines()]
    (driver, holds), *workers = [(int(pid), flag == "True") for pid, flag in lines]
    assert holds, lines  # the driver imports it first, and keeps the password: the test sees it when it is there
    assert len({pid for pid, _ in workers} - {driver, os.getpid()}) >= 2, lines  # the hosts, the coordinator
    assert not any(held for _, held in workers), lines
    # a healthy run's console has no Ray warnings or errors (token-auth default, actor-restart caveat)
    assert "WARNING" not in done.stderr and "ERROR" not in done.stderr and "core_worker" not in done.stderr, done.stderr
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("quickstart")
    assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
    (run,) = client.search_runs([experiment.experiment_id])
    tags, params = run.data.tags, run.data.params
    assert run.info.run_name == "flame-fmnist-q2-s1"
    assert tags["mlflow.source.name"] == f"raysim run {config} {' '.join(options)}"
    assert tags["mlflow.source.type"] == "JOB" and tags["mlflow.user"]  # JOB: the runs table shows it whole
    assert len(tags["mlflow.source.git.commit"]) == 40
    assert tags["mlflow.note.content"].startswith("flame on fashion_mnist, partition q_label, 10 clients, 1 rounds")
    assert "malicious_clients" not in tags and "git_commit" not in tags  # no attack: no empty tag
    assert "None" not in params.values() and "tracking.run_name" not in params
    assert {"system/cpu_utilization_percentage", "system/system_memory_usage_megabytes"} <= set(run.data.metrics)
    (dataset_input,) = run.inputs.dataset_inputs
    assert dataset_input.dataset.name == "fashion_mnist/q2" and len(dataset_input.dataset.digest) == 16
    assert [(t.key, t.value) for t in dataset_input.tags] == [("mlflow.data.context", "training")]
