"""The Python API (raysim.run, raysim.run_suite): real runs on the shared local Ray, read back from a sqlite MLflow
store. The result's tables are what MLflow logged, its final models score on the clients' test splits what the run
logged, and every way of giving a config gives the same one; bad input is the command line's one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

import raysim
from raysim.api import experiment_config
from raysim.cli import main
from raysim.config import load_config
from raysim.errors import ConfigError
from tests.support.experiments import tiny_config
from tests.support.stores import fresh_store


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    return fresh_store(tmp_path_factory.mktemp("api") / "mlflow.db")


def test_a_path_a_dict_and_a_config_with_overrides_are_the_same_experiment(tmp_path):
    tree = tiny_config()
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(tree))
    overrides = ["rounds=5", "partition.beta=0.3", "clients.count=6"]
    from_path = experiment_config(path, overrides, tracking_uri="sqlite:///elsewhere.db")
    assert from_path == load_config(path, [*overrides, "tracking.uri=sqlite:///elsewhere.db"])  # as `raysim run`
    assert experiment_config(tree, overrides, tracking_uri="sqlite:///elsewhere.db") == from_path
    assert experiment_config(load_config(path), overrides, tracking_uri="sqlite:///elsewhere.db") == from_path
    assert (from_path.rounds, from_path.partition.beta, from_path.tracking.uri) == (5, 0.3, "sqlite:///elsewhere.db")
    assert tree["rounds"] == 3  # the caller's dict is left as it was


@pytest.mark.parametrize(
    ("config", "overrides"),
    [
        ("missing.yaml", []),
        ("experiment.yaml", ["partition.q=two"]),
        ("experiment.yaml", ["clients.countt=3"]),
        ("experiment.yaml", ["algorithm.name=flamingo"]),
    ],
    ids=["missing-file", "bad-value", "unknown-key", "unknown-algorithm"],
)
def test_bad_input_is_the_command_line_s_one_line_before_any_run(tmp_path, capsys, config, overrides):
    (tmp_path / "experiment.yaml").write_text(yaml.safe_dump(tiny_config(partition={"scheme": "q_label", "q": 2})))
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"  # refused: no store is made
    path = str(tmp_path / config)
    with pytest.raises(ConfigError) as raised:
        raysim.run(path, *overrides, progress=False, tracking_uri=store)
    assert main(["run", path, *(part for o in overrides for part in ("--set", o)), "--tracking-uri", store]) == 2
    assert capsys.readouterr().err == f"error: {raised.value}\n"
    assert "\n" not in str(raised.value) and not Path(tmp_path / "mlflow.db").exists()


def test_a_config_of_the_wrong_type_and_an_experiment_given_to_run_suite_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="a YAML file's path, a dict or an ExperimentConfig"):
        raysim.run(["rounds: 2"])
    path = tmp_path / "experiment.yaml"
    path.write_text(yaml.safe_dump(tiny_config()))
    with pytest.raises(ConfigError, match="not a suite"):
        raysim.run_suite(path)
