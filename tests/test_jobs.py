"""What `raysim submit` ships with a job, and where it finds the cluster token (the submission itself runs
against a real cluster in tests/test_cluster.py)."""

from __future__ import annotations

import json

import pytest
import yaml

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.jobs import auth_token, job_config_yaml
from raysim.sweep import parse_sweep
from tests.conftest import tiny_config


def test_experiment_job_carries_the_validated_config_and_tracking_uri(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(tiny_config()))
    text, uri = job_config_yaml("experiment", path, ["rounds=9"], "http://127.0.0.1:5000")
    shipped = validate_config(yaml.safe_load(text))
    assert (shipped.rounds, shipped.tracking.uri, uri) == (9, "http://127.0.0.1:5000", "http://127.0.0.1:5000")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://env:5000")
    assert job_config_yaml("experiment", path, [], None)[1] == "http://env:5000"


def test_sweep_job_inlines_its_base_config(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / "base.yaml").write_text(json.dumps(tiny_config()))
    path = tmp_path / "sweep.yaml"
    path.write_text(json.dumps({"name": "s", "base_config": "base.yaml", "grid": {"algorithm.rho": [0.1, 0.2]}}))
    text, uri = job_config_yaml("sweep", path, [], None)
    shipped = parse_sweep(yaml.safe_load(text))
    assert uri == "" and shipped.base_config is None and shipped.base["rounds"] == 3
    assert len(shipped.trials("sqlite:////tmp/x.db")) == 2


def test_bad_config_fails_before_submitting(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(tiny_config(rounds=0)))
    with pytest.raises(ConfigError, match="rounds"):
        job_config_yaml("experiment", path, [], None)


def test_token_order_explicit_env_file_and_disabled(tmp_path, monkeypatch):
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    assert auth_token() == "from-file"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert auth_token() == "from-env"
    assert auth_token("explicit") == "explicit"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert auth_token("explicit") is None
