"""Hostile config input (not UTF-8, nested thousands deep, a bool or a non-finite float for a number, a `partition.q`
above the class count) is one `error:` line, exit 2, before any Ray or MLflow work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from raysim.config import is_suite_file, is_sweep_file, load_config
from raysim.errors import ConfigError
from raysim.studies.suite import load_suite
from raysim.studies.sweep import load_sweep
from tests.support.hostile_input import (
    CLI_CASES,
    CONFIGS,
    DEEP,
    check_refused,
    cli_case,
    quickstart_with,
    write_hostile,
)


def _refusal(path: Path, overrides: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as raised:
        load_config(path, overrides)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_a_file_that_is_not_utf8_is_refused_naming_the_file_and_the_byte(tmp_path):
    path = write_hostile(tmp_path / "latin.yaml", quickstart_with(), b"notes: caf\xe9\n")
    message = _refusal(path)
    assert message.startswith(f"{path}: ") and "not UTF-8" in message and "byte 0xe9" in message


@pytest.mark.parametrize(
    "tail",
    [
        "notes: " + "[" * DEEP + "]" * DEEP,
        "notes: " + "{a: " * DEEP + "1" + "}" * DEEP,
        "notes:\n" + "".join("  " * level + "a:\n" for level in range(1, 400)) + "  " * 400 + "a: 1",
        "notes: &loop [*loop]",
    ],
    ids=["flow-lists", "flow-mappings", "block-mappings", "self-reference"],
)
def test_deeply_nested_yaml_is_refused_naming_the_file(tmp_path, tail):
    path = write_hostile(tmp_path / "deep.yaml", quickstart_with(), tail.encode())
    message = _refusal(path)
    assert message.startswith(f"{path}: nested too deeply"), message


@pytest.mark.parametrize(
    "assignment",
    ["rounds=" + "[" * DEEP + "]" * DEEP, "algorithm.lr=" + "{a: " * DEEP + "1" + "}" * DEEP, "a." * DEEP + "b=1"],
    ids=["list-value", "mapping-value", "key-path"],
)
def test_deeply_nested_set_values_are_refused_naming_the_assignment(tmp_path, assignment):
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (assignment,))
    assert message.startswith(f"--set {assignment.split('.')[0].split('=')[0]}") and "nested too deeply" in message


def test_a_set_value_that_is_not_yaml_is_one_line(tmp_path):
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), ("rounds=[1",))
    assert message.startswith("--set rounds: not valid YAML")


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({"rounds": True}, "rounds: must be an integer, not a bool (got true)"),
        ({"seed": False}, "seed: must be an integer, not a bool (got false)"),
        ({"algorithm.lr": True}, "algorithm.lr: must be a number, not a bool (got true)"),
        ({"algorithm.epochs": True}, "algorithm.epochs: must be an integer, not a bool"),
        ({"algorithm.lr": float("inf")}, "algorithm.lr: Input should be a finite number"),
        ({"algorithm.lr": float("nan")}, "algorithm.lr: Input should be a finite number"),
        ({"algorithm.lambda": float("-inf")}, "algorithm.lambda: Input should be a finite number"),
        ({"partition.q": True}, "partition.q: must be an integer, not a bool"),
        ({"partition.test_fraction": True}, "partition.test_fraction: must be a number, not a bool"),
        ({"clients.count": True}, "clients.count: must be an integer, not a bool"),
        ({"clients.fraction": True}, "clients.fraction: must be a number, not a bool"),
        ({"runtime.host_cpus": True}, "runtime.host_cpus: must be a number, not a bool"),
        ({"runtime.host_resources": {"worker": True}}, "runtime.host_resources.worker: must be a number, not a bool"),
        ({"tracking.eval_every": True}, "tracking.eval_every: must be an integer, not a bool"),
        ({"attack.kind": "gaussian", "attack.fraction": True}, "attack.fraction: must be a number, not a bool"),
        ({"attack.std": float("inf")}, "attack.std: Input should be a finite number"),
        ({"aggregation.byzantine": True}, "aggregation.byzantine: must be an integer, not a bool"),
        ({"aggregation.trim_fraction": float("nan")}, "aggregation.trim_fraction: Input should be a finite number"),
        (
            {"algorithm": {"name": "augfl", "transfer": {"negatives": True}}},
            "algorithm.transfer.negatives: must be an integer, not a bool",
        ),
        (
            {"partition": {"scheme": "meta", "classes_per_client": True}},
            "partition.classes_per_client: must be an integer, not a bool",
        ),
    ],
    ids=lambda value: "-".join(value) if isinstance(value, dict) else None,
)
def test_a_bool_or_non_finite_float_for_a_number_is_refused_naming_the_field(tmp_path, changes, expected):
    """As YAML the file holds `true`, `.inf`, `.nan`: what a person types, not what Python writes."""
    message = _refusal(write_hostile(tmp_path / "experiment.yaml", quickstart_with(**changes)))
    assert message.startswith(expected), message


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"runs": [{"name": "a", "set": {}}], "seeds": [1, True]}, "seeds.1: must be an integer, not a bool"),
        (
            {"random": {"count": True, "params": {"rounds": {"randint": [1, 2]}}}},
            "random.count: must be an integer, not a bool",
        ),
        (
            {"random": {"count": 1, "params": {"rounds": {"uniform": [0, True]}}}},
            "random.params.rounds.uniform.1: must be a number, not a bool",
        ),
    ],
    ids=["suite-seeds", "sweep-count", "sweep-uniform"],
)
def test_suites_and_sweeps_refuse_a_bool_for_a_number(tmp_path, section, expected):
    path = tmp_path / "family.yaml"
    (tmp_path / "quickstart.yaml").write_text((CONFIGS / "quickstart.yaml").read_text())
    family = {"name": "f", "base_config": "quickstart.yaml", **section}
    write_hostile(path, family)
    with pytest.raises(ConfigError, match=expected.replace(".", r"\.")):
        (load_suite if "runs" in family else load_sweep)(path)


def test_numbers_lists_and_real_bools_still_validate(tmp_path):
    """Not strict mode: an int for a float, a list for a tuple, a bool for a bool field all stay valid."""
    config = load_config(
        write_hostile(tmp_path / "experiment.yaml", quickstart_with(**{"algorithm.lr": 1, "dataset.download": False})),
        ("runtime.host_resources={worker: 1}", "partition={scheme: dirichlet, overlap: true}"),
    )
    assert config.algorithm.lr == 1.0 and isinstance(config.algorithm.lr, float) and config.dataset.download is False
    assert config.partition.overlap is True and config.runtime.host_resources == {"worker": 1.0}
    (tmp_path / "quickstart.yaml").write_text((CONFIGS / "quickstart.yaml").read_text())
    random = {"count": 2, "params": {"algorithm.lr": {"uniform": [0, 1]}}}
    sweep = write_hostile(tmp_path / "sweep.yaml", {"name": "w", "base_config": "quickstart.yaml", "random": random})
    assert load_sweep(sweep).random.params["algorithm.lr"].uniform == (0.0, 1.0)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_still_validates(path):
    if is_suite_file(path):
        assert load_suite(path).experiments()
    elif is_sweep_file(path):
        assert load_sweep(path).trials("sqlite:////nonexistent/mlflow.db")
    else:
        assert load_config(path).rounds >= 1


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_the_cli_refuses_with_one_error_line_before_ray_or_mlflow(tmp_path, monkeypatch, capsys, case):
    import ray

    from raysim.cli import main
    from raysim.tracking.mlflow_writer import MlflowWriter

    def touched(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("Ray or MLflow was started")

    monkeypatch.setattr(ray, "init", touched)
    monkeypatch.setattr(MlflowWriter, "__init__", touched)
    monkeypatch.chdir(tmp_path)
    code = main(cli_case(tmp_path, case))
    out = capsys.readouterr()
    check_refused(code, out.out, out.err, tmp_path, CLI_CASES[case][3])


@pytest.mark.parametrize(
    ("assignment", "key", "value"),
    [
        ("tracking.experiment=my exp #2", "experiment", "my exp #2"),
        ("tracking.run_name=yes", "run_name", "yes"),
        ("tracking.run_name=2024-01-01", "run_name", "2024-01-01"),
        ("tracking.run_name=[a] {b}: c", "run_name", "[a] {b}: c"),
        ("tracking.checkpoint_dir= /x #y ", "checkpoint_dir", " /x #y "),
        ('tracking={experiment: "a #b", run_name: c}', "experiment", "a #b"),
    ],
)
def test_names_are_literal_strings(tmp_path, assignment, key, value):
    """A text field's --set value is what was typed: YAML dropped ` #2` as a comment, made `yes` a bool and
    `2024-01-01` a date."""
    config = load_config(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (assignment,))
    assert getattr(config.tracking, key) == value


@pytest.mark.parametrize(
    ("left_out", "assignments", "section", "key", "value"),
    [
        (None, ("dataset.root=/data/fmnist #2",), "dataset", "root", "/data/fmnist #2"),
        ("dataset", ("dataset.root=no",), "dataset", "root", "no"),  # no dataset section: the default source's
        (None, ("dataset.name=npz", "dataset.path=yes"), "dataset", "path", "yes"),
        (None, ("partition.scheme=file", "partition.path=2024-01-01"), "partition", "path", "2024-01-01"),
    ],
)
def test_text_fields_of_the_chosen_settings_are_literal(tmp_path, left_out, assignments, section, key, value):
    """The sections a name chooses (`dataset.name`, `partition.scheme`, `algorithm.name`, looked up in their
    registries) have the text fields of the settings chosen, after the --set that switches them."""
    tree = {name: part for name, part in quickstart_with().items() if name != left_out}
    loaded = load_config(write_hostile(tmp_path / "ok.yaml", tree), assignments)
    assert getattr(getattr(loaded, section), key) == value


@pytest.mark.parametrize("section", ["algorithm.name", "dataset.name", "partition.scheme"])
def test_a_choosing_name_is_text_whatever_the_choice(tmp_path, section):
    """`yes` is a name no registry has, said as typed (YAML would have made it True)."""
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (f"{section}=yes",))
    assert message.startswith(f"{section}: unknown ") and "'yes'" in message, message


@pytest.mark.parametrize("assignment", ["rounds=5 #x", "partition={scheme: iid} # iid for now", "algorithm.lr=0.1 #"])
def test_a_yaml_comment_in_a_set_value_is_refused(tmp_path, assignment):
    message = _refusal(write_hostile(tmp_path / "ok.yaml", quickstart_with()), (assignment,))
    path, raw = assignment.split("=", 1)
    assert message.startswith(f"--set {path}: '#") and f"dropped from the value {raw!r}" in message, message
