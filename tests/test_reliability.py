"""Fault tolerance: checkpoints and resume, dead actors, NaN uploads, MLflow outages (issue #8)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.data import partition_dataset
from raysim.errors import ConfigError, PartitionError
from raysim.runtime import checkpoint
from raysim.runtime.driver import DivergenceError, resume_experiment, run_experiment
from tests.conftest import tiny_config

ROUNDS = 5


@dataclass
class _Inner:
    v: np.ndarray
    count: int


@dataclass
class _State:
    theta: np.ndarray
    inner: _Inner
    maybe: np.ndarray | None
    ranks: dict[str, int]
    sent: dict[int, np.ndarray]
    seen: set[int]
    pair: tuple[float, str]


def test_state_tree_round_trips_bit_for_bit(tmp_path):
    state = _State(
        theta=np.array([1e-30, -0.0, np.nan, np.inf], np.float32),
        inner=_Inner(np.arange(6, dtype=np.int64).reshape(2, 3), 7),
        maybe=None,
        ranks={"fc1": 3},
        sent={4: np.float64([0.1, 0.2])},
        seen={3, 1},
        pair=(0.1 + 0.2, "x"),
    )
    path = tmp_path / "s.npz"
    checkpoint.save_tree(path, {"states": {0: state}, "evaluations": 2})
    back = checkpoint.load_tree(path)["states"][0]
    assert back.theta.tobytes() == state.theta.tobytes() and back.theta.dtype == np.float32
    assert back.inner.v.tobytes() == state.inner.v.tobytes() and back.inner.count == 7
    assert back.maybe is None and back.ranks == {"fc1": 3} and back.seen == {1, 3}
    assert back.sent[4].tobytes() == state.sent[4].tobytes()
    assert back.pair == (0.30000000000000004, "x")
    assert [p.name for p in tmp_path.iterdir()] == ["s.npz"]  # no temporary file left behind


def test_truncated_checkpoint_names_the_file(tmp_path):
    path = tmp_path / "host-0.npz"
    checkpoint.save_tree(path, {"a": np.ones(100)})
    path.write_bytes(path.read_bytes()[:50])
    with pytest.raises(checkpoint.CheckpointError, match="host-0.npz"):
        checkpoint.load_tree(path)


def _config(mlflow_uri, tmp_path, **tracking):
    return tiny_config(
        rounds=ROUNDS,
        clients={"count": 6, "per_round": 4},
        tracking={"experiment": "tests", "uri": mlflow_uri, "checkpoint_every": 2,
                  "checkpoint_dir": str(tmp_path / "ckpt"), **tracking},
    )  # fmt: skip


@pytest.fixture(scope="module")
def baseline(ray_local, tmp_path_factory):
    """The uninterrupted run every failure test must reproduce exactly."""
    tmp = tmp_path_factory.mktemp("baseline")
    return run_experiment(validate_config(_config(f"sqlite:///{tmp / 'm.db'}", tmp)), show_progress=False)


def _steps(uri: str, run_id: str, key: str) -> list[int]:
    return [m.step for m in MlflowClient(uri).get_metric_history(run_id, key)]


def test_resumed_run_equals_uninterrupted_run(baseline, mlflow_uri, tmp_path):
    config = validate_config(_config(mlflow_uri, tmp_path))

    def die(round_index, simulation):
        if round_index == 2:  # after round 3 is logged; the last checkpoint is round 2's
            raise KeyboardInterrupt("driver killed")

    with pytest.raises(KeyboardInterrupt):
        run_experiment(config, show_progress=False, inspect=die)
    client = MlflowClient(mlflow_uri)
    run_id = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0].info.run_id
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.run_id == run_id
    assert resumed.summary == baseline.summary
    assert repr(resumed.final) == repr(baseline.final)  # repr: exact floats, and nan equals nan
    for key in ("pm/acc", "time/round", "comm/uplink_bytes_total"):
        steps = _steps(mlflow_uri, run_id, key)
        assert sorted(steps) == sorted(set(steps)), f"{key} logged twice at a step"
    assert sorted(_steps(mlflow_uri, run_id, "pm/acc")) == list(range(ROUNDS + 1))
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
    assert (tmp_path / "ckpt" / run_id / "round-000004" / "manifest.json").exists()


def test_killed_host_and_coordinator_are_restored_and_the_run_is_unchanged(baseline, mlflow_uri, tmp_path):
    config = validate_config(_config(mlflow_uri, tmp_path))
    killed: list[str] = []

    def kill(round_index, simulation):
        targets = {1: ("host", simulation.hosts[0]), 2: ("coordinator", simulation.coordinator)}
        if round_index in targets and targets[round_index][0] not in killed:
            name, actor = targets[round_index]
            pid = ray.get(actor.pid.remote())
            os.kill(pid, signal.SIGKILL)  # a real process death, mid-run
            killed.append(name)

    result = run_experiment(config, show_progress=False, inspect=kill)
    assert killed == ["host", "coordinator"]
    assert result.summary == baseline.summary
    assert repr(result.final) == repr(baseline.final)
    steps = _steps(mlflow_uri, result.run_id, "time/round")
    assert sorted(steps) == list(range(1, ROUNDS + 1))


def test_nonfinite_upload_stops_the_run_and_marks_it_failed(ray_local, mlflow_uri, tmp_path):
    data = _config(mlflow_uri, tmp_path)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    with pytest.raises(DivergenceError, match=r"round 0: client \d+") as caught:
        run_experiment(validate_config(data), show_progress=False)
    assert "round-000000" in str(caught.value)  # the last good checkpoint is kept and named
    client = MlflowClient(mlflow_uri)
    run = client.search_runs([client.get_experiment_by_name("tests").experiment_id])[0]
    assert run.info.status == "FAILED"
    assert "client" in run.data.tags["raysim.error"]


def test_nonfinite_uploads_can_be_dropped(ray_local, mlflow_uri, tmp_path):
    data = _config(mlflow_uri, tmp_path)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    data["runtime"] = {**data["runtime"], "on_nonfinite": "drop_client"}
    result = run_experiment(validate_config(data), show_progress=False)
    assert result.history[1]["clients/dropped_nonfinite"] == 4.0
    assert np.isfinite(result.summary["final/gm/acc"])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(backend: str, port: int) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend, "--host", "127.0.0.1",
               "--port", str(port), "--workers", "1"]  # fmt: skip
    server = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return server
        except OSError:
            time.sleep(0.3)
    server.kill()
    raise RuntimeError("mlflow server did not start")


@pytest.mark.slow
def test_metrics_survive_a_tracking_server_outage_exactly_once(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "3")
    backend, port = f"sqlite:///{tmp_path / 'server.db'}", _free_port()
    uri = f"http://127.0.0.1:{port}"
    servers = [_start_server(backend, port)]
    outage: dict[str, float] = {}

    def toggle(round_index, simulation):
        if round_index == 0:  # the server goes away mid-run ...
            servers[-1].terminate()
            servers[-1].wait(30)
            outage["down"] = time.monotonic()
        elif round_index == 3:  # ... and comes back (same port, same backend)
            with pytest.raises(OSError):  # rounds 2-4 really ran with the server down
                socket.create_connection(("127.0.0.1", port), timeout=0.5)
            servers.append(_start_server(backend, port))

    try:
        data = _config(uri, tmp_path, checkpoint_every=0)
        result = run_experiment(validate_config(data), show_progress=False, inspect=toggle)
        client = MlflowClient(uri)
        for key in ("pm/acc", "time/round", "client/loss"):
            logged = {m.step: m.value for m in client.get_metric_history(result.run_id, key)}
            assert len(client.get_metric_history(result.run_id, key)) == len(logged), f"{key}: duplicates"
            expected = {s: v for s, v in result.history.items() if key in v}
            assert logged == {s: pytest.approx(v[key], rel=1e-12) for s, v in expected.items()}
        assert client.get_run(result.run_id).info.status == "FINISHED"
    finally:
        for server in servers:
            server.kill()
            server.wait(30)


_HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_SECTIONS = ("algorithm", "dataset", "partition", "model", "clients", "runtime", "tracking", "attack", "aggregation")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    section=st.sampled_from([*_SECTIONS, "rounds", "seed", "bogus"]),
    key=st.one_of(st.sampled_from(["name", "scheme", "count", "lr", "rho", "beta", "q", "checkpoint_every",
                                   "on_nonfinite", "max_restarts", "per_round", "fraction"]), st.text(max_size=6)),
    value=_HOSTILE,
)  # fmt: skip
def test_config_loader_answers_hostile_input_with_a_config_error_only(section, key, value):
    data = tiny_config()
    if section in ("rounds", "seed", "bogus"):
        data[section] = value
    else:
        data[section] = {**data.get(section, {}), key: value}
    try:
        validate_config(data)
    except ConfigError as error:
        message = str(error)
        assert message and "\n" not in message and "Traceback" not in message
        if not message.startswith("set "):  # cross-field rules name both keys in prose
            assert message.split(":")[0].split(".")[0] in (*_SECTIONS, "rounds", "seed", "bogus", "config"), message


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    scheme=st.sampled_from(["iid", "q_label", "dirichlet", "quality", "quantity", "natural", "hybrid", "mixed"]),
    fields=st.dictionaries(
        st.sampled_from(["q", "beta", "min_samples", "overlap", "sigma", "iid_fraction", "test_fraction",
                         "val_fraction"]),
        st.one_of(st.integers(-3, 10**6), st.floats(-1.0, 1e6, allow_nan=False), st.booleans()),
        max_size=3,
    ),
    clients=st.integers(1, 60),
    classes=st.integers(1, 5),
    size=st.integers(0, 120),
)  # fmt: skip
def test_partitioners_answer_hostile_input_with_a_validation_error_only(scheme, fields, clients, classes, size):
    data = tiny_config(partition={"scheme": scheme, **fields}, clients={"count": clients})
    labels = np.random.default_rng(size).integers(0, classes, size)
    groups = np.arange(size) // 3
    try:
        config = validate_config(data)
        splits = partition_dataset(labels, clients, config.partition, 1, groups)
    except (ConfigError, PartitionError) as error:
        assert str(error) and "\n" not in str(error)
        return
    owned = np.concatenate([np.concatenate([s.train, s.test, s.val]) for s in splits])
    assert len(splits) == clients and owned.min(initial=0) >= 0 and owned.max(initial=0) < max(size, 1)


def test_resume_of_an_unknown_run_is_one_error_line(mlflow_uri, tmp_path, capsys):
    from raysim.cli import main

    assert main(["resume", "0123456789abcdef", "--tracking-uri", mlflow_uri]) == 2
    assert "neither a checkpoint folder nor a run id" in capsys.readouterr().err
    (tmp_path / "run").mkdir()
    assert main(["resume", str(tmp_path / "run")]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err


def test_writer_recognizes_a_batch_that_landed_despite_an_error(mlflow_uri):
    """The exactly-once check behind retries: a batch already stored is found, a different one is not."""
    from mlflow.entities import Metric

    from raysim.tracking.mlflow_writer import MlflowWriter

    writer = MlflowWriter(mlflow_uri, "tests")
    writer.start("w", {}, {})
    stored = [Metric("loss", 0.5, 1000, 3), Metric("acc", 0.9, 1000, 3)]
    writer.client.log_batch(writer.run_id, metrics=stored)
    assert writer._landed(stored)
    assert not writer._landed([Metric("loss", 0.5, 1001, 3)])
    assert not writer._landed([Metric("loss", 0.5, 1000, 4)])
    writer.log_metrics(4, {"loss": 0.25, "acc": float("nan")})
    writer.finish("FINISHED", timeout=30)
    assert [(m.step, m.value) for m in writer.client.get_metric_history(writer.run_id, "loss")] == [(3, 0.5), (4, 0.25)]
    assert writer.client.get_run(writer.run_id).info.status == "FINISHED"


@pytest.mark.slow
def test_raysim_resume_picks_up_after_the_driver_process_is_killed(baseline, mlflow_uri, tmp_path):
    import yaml

    data = _config(mlflow_uri, tmp_path, checkpoint_every=1)
    data["runtime"] = {**data["runtime"], "num_cpus": 2}
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    raysim = str(Path(sys.executable).parent / "raysim")
    driver = subprocess.Popen([raysim, "run", str(tmp_path / "run.yaml"), "--quiet"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while not list((tmp_path / "ckpt").glob("*/round-000003/manifest.json")):
            assert driver.poll() is None and time.monotonic() < deadline, "driver ended before round 3"
            time.sleep(0.2)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the local Ray it started: a dead driver
        driver.wait(30)
    run_id = next((tmp_path / "ckpt").iterdir()).name
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "RUNNING"
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.summary == baseline.summary
    steps = _steps(mlflow_uri, run_id, "pm/acc")
    assert sorted(steps) == list(range(ROUNDS + 1))
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
