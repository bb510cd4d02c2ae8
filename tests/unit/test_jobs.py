"""What `raysim submit` ships with a job (config, code package, never a credential), and where it finds the
cluster token (the submission itself runs against a real cluster in tests/system/test_cluster.py)."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import yaml

from raysim.config import validate_config
from raysim.errors import ConfigError
from raysim.jobs import EXCLUDES, PROJECT_ROOT, JobError, auth_token, job_config_yaml, job_spec
from raysim.studies.sweep import parse_sweep
from tests.support.experiments import tiny_config


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


def ray_package(runtime_env: dict, target: Path) -> set[str]:
    """The working_dir package exactly as a Ray job client builds it (Ray's default excludes, .gitignore and
    the runtime env's excludes; ray._private.runtime_env.working_dir / packaging): the names of its files."""
    from ray._private.ray_constants import RAY_RUNTIME_ENV_IGNORE_GITIGNORE
    from ray._private.runtime_env.packaging import create_package
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    include_gitignore = os.environ.get(RAY_RUNTIME_ENV_IGNORE_GITIGNORE, "0") != "1"

    def build(working_dir: str, excludes: list[str], is_file: bool = False) -> None:
        assert not is_file
        create_package(working_dir, target, include_gitignore=include_gitignore, excludes=excludes)

    upload_working_dir_if_needed(dict(runtime_env), include_gitignore=include_gitignore, upload_fn=build)
    with zipfile.ZipFile(target) as package:
        return set(package.namelist())


def test_job_package_ships_all_of_raysim_but_not_the_root_data_and_runs(tmp_path):
    """`data` and `runs` used to be excluded at any depth (gitignore semantics), so raysim/data/ was left out
    and a job only worked by importing the submitter's editable install."""
    (tmp_path / "exp.yaml").write_text(json.dumps(tiny_config()))
    spec = job_spec("experiment", tmp_path / "exp.yaml")
    shipped = ray_package(spec.runtime_env, tmp_path / "project.zip")
    files = [*(PROJECT_ROOT / "raysim").rglob("*.py"), *(PROJECT_ROOT / "jobs").glob("*.py")]
    code = {str(f.relative_to(PROJECT_ROOT)) for f in files if "__pycache__" not in f.parts}
    assert {"raysim/data/partitions.py", "raysim/runtime/driver.py", "jobs/experiment.py"} <= code
    assert code - shipped == set()
    assert not [name for name in shipped if name.startswith((".venv/", ".git/")) or "__pycache__" in name]

    # the same excludes on a project tree holding every folder they name, at the root and deeper
    project = tmp_path / "project"
    for name in (
        "data/train.npz",
        "runs/r1/x.json",
        "checkpoints/c.npz",
        "mlruns/0/m",
        "mlartifacts/a.png",
        ".venv/bin/python",
        "mlflow.db",
        "raysim/__pycache__/x.pyc",
        "x.egg-info/PKG-INFO",
        "raysim/data/sources.py",
        "raysim/runs/keep.py",
        "raysim/tracking/mlflow.db.py",
    ):
        (project / name).parent.mkdir(parents=True, exist_ok=True)
        (project / name).write_text("x")
    env = {"working_dir": str(project), "excludes": EXCLUDES}
    assert ray_package(env, tmp_path / "tree.zip") == {
        "raysim/data/sources.py",
        "raysim/runs/keep.py",
        "raysim/tracking/mlflow.db.py",
    }


def _everything_shipped(spec) -> str:
    return json.dumps(spec.runtime_env) + spec.entrypoint + spec.tracking_uri


def test_http_credentials_are_never_shipped_and_the_submitter_is_told(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    secret = "http://alice:pw@mlflow.example:5000"
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(tiny_config(tracking={"experiment": "tests", "uri": secret})))
    for tracking_uri in (None, secret):  # the config's tracking.uri, or --tracking-uri
        spec = job_spec("experiment", path, ["rounds=2"], tracking_uri)
        assert "pw" not in _everything_shipped(spec) and "alice" not in _everything_shipped(spec)
        env = spec.runtime_env["env_vars"]
        assert env["MLFLOW_TRACKING_URI"] == "http://mlflow.example:5000"
        shipped = validate_config(yaml.safe_load(env["RAYSIM_JOB_CONFIG"]))
        assert (shipped.tracking.uri, shipped.rounds) == ("http://***@mlflow.example:5000", 2)
        assert spec.tracking_uri == "http://***@mlflow.example:5000"
        assert "MLFLOW_TRACKING_USERNAME" in spec.warning and "MLFLOW_TRACKING_PASSWORD" in spec.warning
        assert "pw" not in spec.warning

    # a sweep: its base tree's URI, here from the submitter's environment
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "https://tok3n@mlflow.example")
    (tmp_path / "base.yaml").write_text(json.dumps(tiny_config()))
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(json.dumps({"name": "s", "base_config": "base.yaml", "grid": {"algorithm.rho": [0.1, 0.2]}}))
    spec = job_spec("sweep", sweep)
    assert "tok3n" not in _everything_shipped(spec)
    assert parse_sweep(yaml.safe_load(spec.runtime_env["env_vars"]["RAYSIM_JOB_CONFIG"])).base["tracking"]["uri"] == (
        "https://***@mlflow.example"
    )
    assert "MLFLOW_TRACKING_TOKEN" in spec.warning
    assert job_spec("experiment", path, [], "http://127.0.0.1:5000").warning is None


def test_database_password_is_refused_before_submitting(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(tiny_config()))
    with pytest.raises(JobError, match="tracking server") as refused:
        job_spec("experiment", path, [], "postgresql://alice:pw@db.example/mlflow")
    assert "pw" not in str(refused.value) and "postgresql://***@db.example/mlflow" in str(refused.value)


def test_submit_prints_no_credential_when_it_fails(tmp_path, monkeypatch, capsys):
    from raysim.cli import main
    from tests.support.cluster import free_port

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    path = tmp_path / "exp.yaml"
    path.write_text(json.dumps(tiny_config()))
    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    code = main(["submit", str(path), "--address", address, "--tracking-uri", "http://alice:pw@mlflow.example"])
    captured = capsys.readouterr()
    assert code == 2 and "pw" not in captured.out + captured.err
    assert captured.err.startswith(f"error: --address {address}: cannot reach") and captured.err.count("\n") == 1
