"""Fault tolerance: checkpoints and resume, dead actors, NaN uploads, MLflow outages (issue #8)."""

from __future__ import annotations

import re
import socket
import time

import numpy as np
import pytest
import yaml
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.runtime.driver import DivergenceError, resume_experiment, run_experiment
from tests.support.cluster import free_port
from tests.support.experiments import IN_PROCESS
from tests.support.reliability import ROUNDS, baseline_run, reliability_config, steps_logged
from tests.support.stores import fresh_store

pytestmark = pytest.mark.xdist_group("integration-reliability")
"""One worker runs this module's tests: its uninterrupted baseline run is made once."""


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The uninterrupted run every failure test must reproduce exactly (tests/support/reliability.py)."""
    return baseline_run(tmp_path_factory.mktemp("baseline"), IN_PROCESS)


def test_resumed_run_equals_uninterrupted_run(baseline, mlflow_uri, tmp_path):
    config = validate_config(reliability_config(mlflow_uri, tmp_path, IN_PROCESS))

    def die(round_index, simulation):
        if round_index == 2:  # after round 3 is logged; the last checkpoint is round 2's
            raise KeyboardInterrupt("driver killed")

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, show_progress=False, inspect=die)
    client = MlflowClient(mlflow_uri)
    run_id = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0].info.run_id
    assert client.get_run(run_id).data.tags["raysim.error"] == "interrupted by SIGINT after round 3"
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.run_id == run_id
    assert "raysim.error" not in client.get_run(run_id).data.tags  # finished: the interruption's tag is gone
    assert resumed.summary == baseline.summary
    assert repr(resumed.final) == repr(baseline.final)  # repr: exact floats, and nan equals nan
    for key in ("pm/acc", "time/round", "traffic/uplink_bytes_total"):
        steps = steps_logged(mlflow_uri, run_id, key)
        assert sorted(steps) == sorted(set(steps)), f"{key} logged twice at a step"
    assert sorted(steps_logged(mlflow_uri, run_id, "pm/acc")) == list(range(ROUNDS + 1))
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
    assert (tmp_path / "ckpt" / run_id / "round-000004" / "manifest.json").exists()


def test_a_batchnorm_run_resumes_with_its_running_statistics_exactly(tmp_path):
    """The running statistics are in every client's and the global vector, so the checkpoint holds them: FLAME
    (personal models, duals) with mlp_bn, interrupted after round 3 and resumed, ends as the uninterrupted run."""
    runs = {}
    for name in ("whole", "resumed"):
        data = reliability_config(fresh_store(tmp_path / name / "m.db"), tmp_path / name, IN_PROCESS)
        data["model"] = {"name": "mlp_bn"}
        runs[name] = validate_config(data)
    whole = run_experiment(runs["whole"], show_progress=False)

    def die(round_index, simulation):
        if round_index == 2:
            raise KeyboardInterrupt("driver killed")

    with pytest.raises(KeyboardInterrupt):
        run_experiment(runs["resumed"], show_progress=False, inspect=die)
    uri = runs["resumed"].tracking.uri
    client = MlflowClient(uri)
    run_id = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0].info.run_id
    resumed = resume_experiment(run_id, uri, show_progress=False)
    assert resumed.summary == whole.summary and repr(resumed.final) == repr(whole.final)


def test_nonfinite_upload_stops_the_run_and_marks_it_failed(mlflow_uri, tmp_path):
    data = reliability_config(mlflow_uri, tmp_path, IN_PROCESS)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    with pytest.raises(DivergenceError, match=r"round 0: client \d+") as caught:
        run_experiment(validate_config(data), show_progress=False)
    assert "round-000000" in str(caught.value)  # the last good checkpoint is kept and named
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0]
    assert run.info.status == "FAILED"
    assert "client" in run.data.tags["raysim.error"]


def test_nonfinite_uploads_can_be_dropped(mlflow_uri, tmp_path):
    data = reliability_config(mlflow_uri, tmp_path, IN_PROCESS)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    data["runtime"] = {**data["runtime"], "on_nonfinite": "drop_client", "max_empty_rounds": ROUNDS}
    result = run_experiment(validate_config(data), show_progress=False)
    assert result.history[1]["round/dropped_clients"] == 4.0
    assert np.isfinite(result.summary["final/gm/acc"])


def test_a_round_without_a_usable_upload_stops_the_run(mlflow_uri, tmp_path, capsys):
    """drop_client must not let a run go on at chance accuracy when every upload is dropped: the first such
    round (runtime.max_empty_rounds = 0) stops it with the one-line error of on_nonfinite = stop."""
    data = reliability_config(mlflow_uri, tmp_path, IN_PROCESS)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    data["runtime"] = {**data["runtime"], "on_nonfinite": "drop_client"}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    from raysim.cli import main

    assert main(["run", str(path), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    (line,) = [row for row in err.splitlines() if row.startswith("error:")]
    assert re.fullmatch(
        r"error: run \w{32} stopped: round 0: all 4 selected uploads were non-finite and dropped; last good "
        r"checkpoint \S+round-000000 \(runtime.on_nonfinite=drop_client, runtime.max_empty_rounds=0\)",
        line,
    ), line
    client = MlflowClient(mlflow_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert run.info.status == "FAILED" and "dropped" in run.data.tags["raysim.error"]


def test_a_bounded_number_of_empty_rounds_is_tolerated(mlflow_uri, tmp_path):
    data = reliability_config(mlflow_uri, tmp_path, IN_PROCESS)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    data["runtime"] = {**data["runtime"], "on_nonfinite": "drop_client", "max_empty_rounds": 2}
    with pytest.raises(DivergenceError, match=r"round 2: all 4 selected uploads .*, 3 rounds in a row"):
        run_experiment(validate_config(data), show_progress=False)


def _start_server(backend: str, port: int):
    """An MLflow server in its own process group (stopped with its workers: nothing keeps the port)."""
    from raysim.tracking.server import ServerSettings, TrackingServer

    return TrackingServer(ServerSettings(backend, None, port=port)).start(timeout_s=60)


@pytest.mark.slow
def test_metrics_survive_a_tracking_server_outage_exactly_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    backend, port = f"sqlite:///{tmp_path / 'server.db'}", free_port()
    uri = f"http://127.0.0.1:{port}"
    servers = [_start_server(backend, port)]
    outage: dict[str, float] = {}

    def toggle(round_index, simulation):
        if round_index == 0:  # the server goes away mid-run ...
            servers[-1].stop()
            outage["down"] = time.monotonic()
        elif round_index == 3:  # ... and comes back (same port, same backend)
            with pytest.raises(OSError):  # rounds 2-4 really ran with the server down
                socket.create_connection(("127.0.0.1", port), timeout=0.5)
            servers.append(_start_server(backend, port))

    try:
        data = reliability_config(uri, tmp_path, IN_PROCESS, checkpoint_every=0)
        result = run_experiment(validate_config(data), show_progress=False, inspect=toggle)
        client = MlflowClient(uri)
        for key in ("pm/acc", "time/round", "update/loss"):
            logged = {m.step: m.value for m in client.get_metric_history(result.run_id, key)}
            assert len(client.get_metric_history(result.run_id, key)) == len(logged), f"{key}: duplicates"
            expected = {s: v for s, v in result.history.items() if key in v}
            assert logged == {s: pytest.approx(v[key], rel=1e-12) for s, v in expected.items()}
        assert client.get_run(result.run_id).info.status == "FINISHED"
    finally:
        for server in servers:
            server.stop()
