"""Fault tolerance: checkpoints and resume, dead actors, NaN uploads, MLflow outages (issue #8)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from raysim.config import validate_config
from raysim.data import partition_dataset
from raysim.errors import ConfigError, PartitionError
from raysim.runtime import checkpoint
from tests.support.experiments import tiny_config


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
