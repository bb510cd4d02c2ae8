"""Fault tolerance: checkpoints and resume, dead actors, NaN uploads, MLflow outages (issue #8)."""

from __future__ import annotations

import os
import re
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
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from raysim.config import validate_config
from raysim.data import partition_dataset
from raysim.errors import ConfigError, PartitionError
from raysim.runtime import checkpoint
from raysim.runtime.actors import RecoveryError
from raysim.runtime.driver import DivergenceError, resume_experiment, run_experiment
from tests.support.cluster import free_port
from tests.support.experiments import tiny_config

ROUNDS = 5
ROOT = Path(__file__).resolve().parent.parent


@checkpoint.register_state_class
@dataclass
class _Inner:
    v: np.ndarray
    count: int


@checkpoint.register_state_class
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
        tracking={
            "experiment": "tests",
            "uri": mlflow_uri,
            "checkpoint_every": 2,
            "checkpoint_dir": str(tmp_path / "ckpt"),
            **tracking,
        },
    )


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
    assert client.get_run(run_id).data.tags["raysim.error"] == "interrupted by SIGINT after round 3"
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.run_id == run_id
    assert "raysim.error" not in client.get_run(run_id).data.tags  # finished: the interruption's tag is gone
    assert resumed.summary == baseline.summary
    assert repr(resumed.final) == repr(baseline.final)  # repr: exact floats, and nan equals nan
    for key in ("pm/acc", "time/round", "traffic/uplink_bytes_total"):
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
    data["runtime"] = {**data["runtime"], "on_nonfinite": "drop_client", "max_empty_rounds": ROUNDS}
    result = run_experiment(validate_config(data), show_progress=False)
    assert result.history[1]["round/dropped_clients"] == 4.0
    assert np.isfinite(result.summary["final/gm/acc"])


def test_a_round_without_a_usable_upload_stops_the_run(ray_local, mlflow_uri, tmp_path, capsys):
    """drop_client must not let a run go on at chance accuracy when every upload is dropped: the first such
    round (runtime.max_empty_rounds = 0) stops it with the one-line error of on_nonfinite = stop."""
    data = _config(mlflow_uri, tmp_path)
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


def test_a_bounded_number_of_empty_rounds_is_tolerated(ray_local, mlflow_uri, tmp_path):
    data = _config(mlflow_uri, tmp_path)
    data["algorithm"] = {**data["algorithm"], "lr": 1e30}
    data["runtime"] = {**data["runtime"], "on_nonfinite": "drop_client", "max_empty_rounds": 2}
    with pytest.raises(DivergenceError, match=r"round 2: all 4 selected uploads .*, 3 rounds in a row"):
        run_experiment(validate_config(data), show_progress=False)


@pytest.mark.parametrize(
    ("restarts", "timeout", "message"),
    [
        (1, 0.01, r"^host 1 not back 0.01 s after dying .*runtime.restore_timeout_s"),
        (0, 300, r"^host 1 died and cannot be replaced: runtime.max_restarts=0 replacements used up"),
    ],
)
def test_restore_gives_up_naming_the_actor(ray_local, mlflow_uri, tmp_path, restarts, timeout, message):
    """A replacement host that is not restored within runtime.restore_timeout_s, or a dead host with no
    replacement left, stops the run with one line naming the host."""
    data = _config(mlflow_uri, tmp_path)
    data["runtime"] = {**data["runtime"], "max_restarts": restarts, "restore_timeout_s": timeout}

    def kill(round_index, simulation):
        if round_index == 2:
            os.kill(ray.get(simulation.hosts[1].pid.remote()), signal.SIGKILL)

    started = time.monotonic()
    with pytest.raises(RecoveryError, match=message):
        run_experiment(validate_config(data), show_progress=False, inspect=kill)
    assert time.monotonic() - started < 120


@pytest.mark.slow
def test_killed_host_of_the_shipped_quickstart_is_restored(ray_local, tmp_path):
    """The shipped quickstart on Fashion-MNIST (fewer rounds): a host's client list (~280 KB) is larger than
    Ray's inline limit, so a restarted host is built from object-store arguments that must still be alive."""
    from raysim.config import load_config

    def config(name: str):
        return load_config(
            ROOT / "configs" / "quickstart.yaml",
            [
                "rounds=4",
                "tracking.checkpoint_every=2",
                f"tracking.uri=sqlite:///{tmp_path / name}.db",
                f"tracking.checkpoint_dir={tmp_path / name}",
                "tracking.figures=[]",
                "tracking.save_models=none",
            ],
        )

    baseline = run_experiment(config("baseline"), show_progress=False)
    killed: list[int] = []

    def kill(round_index, simulation):
        if round_index == 2 and not killed:  # round 3 is logged; the last checkpoint is round 2's
            killed.append(ray.get(simulation.hosts[0].pid.remote()))
            os.kill(killed[0], signal.SIGKILL)

    result = run_experiment(config("killed"), show_progress=False, inspect=kill)
    assert killed
    assert result.summary == baseline.summary
    assert repr(result.final) == repr(baseline.final)
    uri = f"sqlite:///{tmp_path / 'killed'}.db"
    for key in ("time/round", "pm/acc"):
        steps = _steps(uri, result.run_id, key)
        assert sorted(steps) == list(range(0 if key == "pm/acc" else 1, 5)), (key, steps)


def _cli(tmp_path: Path, data: dict, timeout: float = 120) -> subprocess.CompletedProcess:
    """`raysim run` in a process of its own (this test process may have started Ray already)."""
    (tmp_path / "cli.yaml").write_text(yaml.safe_dump(data))
    raysim = str(Path(sys.executable).parent / "raysim")
    return subprocess.run(
        [raysim, "run", str(tmp_path / "cli.yaml"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=tmp_path,
    )


@pytest.mark.parametrize(
    ("runtime", "expected"),
    [
        (
            {"host_cpus": 1000},
            r"1 hosts \(runtime.num_hosts=default, .*\) x runtime.host_cpus=1000 .* needs 1000 "
            r"CPUs but the Ray cluster has 2; lower runtime.host_cpus",
        ),
        (
            {"num_hosts": 50},
            r"6 hosts \(runtime.num_hosts=50, at most one per client\) x runtime.host_cpus=1 .* "
            r"needs 6 CPUs but the Ray cluster has 2",
        ),
    ],
)
def test_hosts_beyond_the_machine_are_refused_before_ray_or_mlflow(tmp_path, runtime, expected):
    data = _config(f"sqlite:///{tmp_path / 'm.db'}", tmp_path)
    data["runtime"] = {**runtime, "num_cpus": 2}
    done = _cli(tmp_path, data)
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()  # Ray would have printed its own lines on starting
    assert re.fullmatch(f"error: {expected}.*", line), line
    assert not (tmp_path / "m.db").exists()


def test_unreachable_tracking_server_fails_fast_before_ray(tmp_path):
    port = free_port()
    data = _config(f"http://127.0.0.1:{port}", tmp_path)
    with socket.socket() as silent:  # accepts connections, never answers: the slow case
        silent.bind(("127.0.0.1", port))
        silent.listen()
        data["tracking"] = {**data["tracking"], "connect_timeout_s": 2}
        started = time.monotonic()
        done = _cli(tmp_path, data)
        elapsed = time.monotonic() - started
    assert done.returncode == 2 and elapsed < 60, (elapsed, done.stderr)
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"error: tracking.uri http://127.0.0.1:{port}: MLflow server not reachable within 2 s")
    done = _cli(tmp_path, _config(f"http://127.0.0.1:{port}", tmp_path))  # nobody listens: refused at once
    (line,) = done.stderr.strip().splitlines()
    assert done.returncode == 2 and "not reachable" in line and "Connection refused" in line, line


def _raysim(
    tmp_path: Path, *args: str, env: dict[str, str], watch: list[str] | None = None
) -> subprocess.CompletedProcess:
    """`raysim ARGS` run to its end; `watch`: gets the process's command line as the system shows it (`ps`, and
    Ray, which records it as the job's entrypoint) once its local Ray is up."""
    from raysim.studies.procmem import descendants

    raysim = str(Path(sys.executable).parent / "raysim")
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_TRACKING_", "RAY_ADDRESS"))}
    process = subprocess.Popen(
        [raysim, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**environment, **env},
    )
    if watch is not None:
        deadline = time.monotonic() + 240
        while (
            process.poll() is None
            and time.monotonic() < deadline
            and not [pid for pid in descendants(process.pid) if _comm(pid) == "gcs_server"]
        ):
            time.sleep(0.1)
        watch.append(Path(f"/proc/{process.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
    stdout, stderr = process.communicate(timeout=300)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def _comm(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _files_holding(folder: Path, secrets: list[str], skip: set[Path]) -> list[str]:
    """Every file under `folder` (the tracking server's database and artifacts, the checkpoints) whose bytes hold
    one of `secrets`, raw or percent-encoded."""
    import urllib.parse

    needles = {form.encode() for secret in secrets for form in (secret, urllib.parse.quote(secret, safe=""))}
    return [
        str(path)
        for path in folder.rglob("*")
        if path.is_file() and path not in skip and any(needle in path.read_bytes() for needle in needles)
    ]


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        (
            "postgresql://alice:pw@127.0.0.1/mlflow",
            "error: tracking.uri postgresql://***@127.0.0.1/mlflow: its "
            "database driver 'psycopg' is not installed (No module named 'psycopg'); install it, or name an installed "
            "one as postgresql+DRIVER://",
        ),
        (
            "mysql+nodriver://127.0.0.1/mlflow",
            "error: tracking.uri mysql+nodriver://127.0.0.1/mlflow: not a usable database URL",
        ),
        (
            "ftp://alice:pw@127.0.0.1/mlflow",
            "error: tracking.uri ftp://***@127.0.0.1/mlflow: MLflow has no tracking store for scheme 'ftp'; allowed: ",
        ),
    ],
    ids=["postgresql-without-driver", "unknown-driver", "ftp"],
)
def test_a_tracking_store_mlflow_cannot_open_is_refused_before_ray(tmp_path, uri, expected):
    """A traceback (postgresql://, its driver not installed) or one line after Ray had started (ftp://): both
    are known before anything starts."""
    import importlib.util

    if uri.startswith("postgresql") and importlib.util.find_spec("psycopg") is not None:
        pytest.skip("psycopg is installed here")
    done = _cli(tmp_path, _config(uri, tmp_path))
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()  # Ray would have printed its own lines on starting
    assert line.startswith(expected), line


@pytest.mark.slow
def test_credentials_are_stored_and_printed_nowhere_wherever_they_come_from(tmp_path):
    """Passwords holding `@` (redacted only up to it before) in a config file, a --set, a --tracking-uri and the
    environment ($MLFLOW_TRACKING_URI, $MLFLOW_TRACKING_PASSWORD): none reaches the console, the tracking server's
    database (params, tags: the command line in `mlflow.source.name` and `mlflow.note.content`), its artifacts or
    the checkpoints; two real runs against a real MLflow server."""
    from raysim.tracking.server import ServerSettings, TrackingServer

    secrets = [f"pw{i}@s3cret:{i}" for i in range(5)]
    settings = ServerSettings(f"sqlite:///{tmp_path / 'server.db'}", str(tmp_path / "artifacts"), port=free_port())
    host = f"127.0.0.1:{settings.port}"
    with TrackingServer(settings, tmp_path / "server.log"):
        config = tmp_path / "cli.yaml"
        in_file = {**_config(f"http://alice:{secrets[0]}@{host}", tmp_path, checkpoint_every=1), "rounds": 2}
        config.write_text(yaml.safe_dump(in_file))
        typed = [
            "--set",
            f"tracking.uri=http://alice:{secrets[1]}@{host}",
            "--tracking-uri",
            f"http://alice:{secrets[2]}@{host}",
        ]
        environment = {"MLFLOW_TRACKING_URI": f"http://bob:{secrets[3]}@{host}", "MLFLOW_TRACKING_PASSWORD": secrets[4]}
        seen: list[str] = []
        done = _raysim(tmp_path, "run", str(config), "--quiet", *typed, env=environment, watch=seen)
        assert done.returncode == 0, done.stderr[-2000:]
        printed = done.stdout + done.stderr
        assert not [secret for secret in secrets if secret.split("@")[1] in seen[0]]
        assert f"--tracking-uri http://***@{host}" in seen[0]  # as `ps` and Ray's job table see it
        from_environment = {**_config(None, tmp_path, checkpoint_every=1), "rounds": 2}
        del from_environment["tracking"]["uri"]
        config.write_text(yaml.safe_dump(from_environment))
        again = _raysim(
            tmp_path, "run", str(config), "--quiet", env={"MLFLOW_TRACKING_URI": f"http://bob:{secrets[3]}@{host}"}
        )
        assert again.returncode == 0, again.stderr[-2000:]
        printed += again.stdout + again.stderr
        client = MlflowClient(settings.url)
        runs = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert len(runs) == 2
    assert not [secret for secret in secrets if secret in printed or secret.split("@")[1] in printed], printed
    first = next(run for run in runs if "--tracking-uri" in run.data.tags["mlflow.source.name"])
    assert (
        f"--set tracking.uri=http://***@{host} --tracking-uri http://***@{host}"
        in first.data.tags["mlflow.source.name"]
    )
    assert f"--tracking-uri http://***@{host}" in first.data.tags["mlflow.note.content"]
    assert first.data.params["tracking.uri"] == f"http://***@{host}"
    stored = [value for run in runs for value in [*run.data.params.values(), *run.data.tags.values()]]
    assert not [value for value in stored for secret in secrets if secret.split("@")[1] in value]
    assert list((tmp_path / "ckpt").glob("*/round-*/manifest.json"))
    held = _files_holding(tmp_path, [secret.split("@")[1] for secret in secrets], skip={config})
    assert not held, held


@pytest.mark.parametrize(
    ("uri", "shown"),
    [
        ("http://user:pw@host:5000", "http://***@host:5000"),
        ("https://token@host/mlflow", "https://***@host/mlflow"),
        ("postgresql://user:p%40ss@db:5432/mlflow", "postgresql://***@db:5432/mlflow"),
        ("postgresql+psycopg2://u:p@db/m?sslmode=require", "postgresql+psycopg2://***@db/m?sslmode=require"),
        ("sqlite:///mlflow.db", "sqlite:///mlflow.db"),
        ("http://127.0.0.1:5000", "http://127.0.0.1:5000"),
    ],
)
def test_redact_hides_user_info_of_any_uri(uri, shown):
    from raysim.credentials import redact, redact_text

    assert redact(uri) == shown
    assert redact_text(f"error: cannot reach {uri} (refused)") == f"error: cannot reach {shown} (refused)"


def test_http_credentials_move_into_mlflow_variables(monkeypatch):
    from raysim.credentials import connect_uri

    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    assert connect_uri("http://al%40ice:p%3Aw@host:5000/x") == "http://host:5000/x"
    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("al@ice", "p:w")
    assert connect_uri("https://tok@host") == "https://host" and os.environ["MLFLOW_TRACKING_TOKEN"] == "tok"
    assert connect_uri("http://***@host:5000") == "http://host:5000"  # redacted: the variables must hold them
    assert connect_uri("postgresql://u:p@db/m") == "postgresql://u:p@db/m"  # SQLAlchemy needs them


def _start_server(backend: str, port: int):
    """An MLflow server in its own process group (stopped with its workers: nothing keeps the port)."""
    from raysim.tracking.server import ServerSettings, TrackingServer

    return TrackingServer(ServerSettings(backend, None, port=port)).start(timeout_s=60)


@pytest.mark.slow
def test_metrics_survive_a_tracking_server_outage_exactly_once(ray_local, tmp_path, monkeypatch):
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
        data = _config(uri, tmp_path, checkpoint_every=0)
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


_HOSTILE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
_SECTIONS = (
    "algorithm",
    "dataset",
    "partition",
    "model",
    "clients",
    "runtime",
    "tracking",
    "attack",
    "aggregation",
    "network",
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    section=st.sampled_from([*_SECTIONS, "rounds", "seed", "bogus"]),
    key=st.one_of(
        st.sampled_from(
            [
                "name",
                "scheme",
                "count",
                "lr",
                "rho",
                "beta",
                "q",
                "checkpoint_every",
                "on_nonfinite",
                "max_restarts",
                "per_round",
                "fraction",
                "sampling",
                "bandwidth_mbps",
                "link",
            ]
        ),
        st.text(max_size=6),
    ),
    value=_HOSTILE,
)
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
        st.sampled_from(
            ["q", "beta", "min_samples", "overlap", "sigma", "iid_fraction", "test_fraction", "val_fraction"]
        ),
        st.one_of(st.integers(-3, 10**6), st.floats(-1.0, 1e6, allow_nan=False), st.booleans()),
        max_size=3,
    ),
    clients=st.integers(1, 60),
    classes=st.integers(1, 5),
    size=st.integers(0, 120),
)
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
def test_raysim_resume_picks_up_after_the_driver_process_is_killed(ray_local, mlflow_uri, tmp_path):
    """Long enough (30 rounds) that the driver is surely mid-run when a checkpoint of round 3 or later appears,
    however fast rounds are; the resumed run must end exactly as an uninterrupted one."""
    rounds = 30
    data = _config(mlflow_uri, tmp_path, checkpoint_every=1) | {"rounds": rounds}
    data["runtime"] = {**data["runtime"], "num_cpus": 2}
    reference = _config(f"sqlite:///{tmp_path / 'reference.db'}", tmp_path / "reference") | {"rounds": rounds}
    expected = run_experiment(validate_config(reference), show_progress=False)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(data))
    raysim = str(Path(sys.executable).parent / "raysim")
    driver = subprocess.Popen(
        [raysim, "run", str(tmp_path / "run.yaml"), "--quiet"],
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def checkpointed() -> int:
        return max(
            (int(p.parent.name.split("-")[1]) for p in (tmp_path / "ckpt").glob("*/round-*/manifest.json")), default=0
        )

    try:
        deadline = time.monotonic() + 240
        while checkpointed() < 3:
            assert driver.poll() is None and time.monotonic() < deadline, "driver ended before round 3"
            time.sleep(0.05)
    finally:
        os.killpg(driver.pid, signal.SIGKILL)  # the driver and the local Ray it started: a dead driver
        driver.wait(30)
    assert checkpointed() < rounds  # killed mid-run
    run_id = next((tmp_path / "ckpt").iterdir()).name
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "RUNNING"
    resumed = resume_experiment(run_id, mlflow_uri, show_progress=False)
    assert resumed.summary == expected.summary
    steps = _steps(mlflow_uri, run_id, "pm/acc")
    assert sorted(steps) == list(range(rounds + 1))
    assert MlflowClient(mlflow_uri).get_run(run_id).info.status == "FINISHED"
